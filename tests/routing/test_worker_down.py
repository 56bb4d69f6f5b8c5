"""An engine whose worker died while its scheduler stays up, over real processes: two engines
behind the gateway, one's worker SIGKILLed while greedy streams run on both. Every stream
completes, on the other engine, with exactly the fault-free text and usage; while the worker is
down the gateway routes nothing to that engine (its scheduler reports the worker down, so it does
not pass for the least loaded engine); once the worker is started again, the engine takes requests
again. Without the report, migrated and new sequences went to the worker-less engine, failed there
at once and used up their migration attempts."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from .cluster import Cluster, metric, running_cluster, scrape, wait_until
from .streams import MAX_TOKENS, Stream, run

N = 8
VICTIM = 1


def greedy_requests(n: int) -> list[Stream]:
    return [Stream([5 + 37 * i + j for j in range(12 + i)],
                   {"temperature": 0.0, "ignore_eos": True}) for i in range(n)]


@pytest.fixture
def pair(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # least_load: the engine whose requests all just failed is the least loaded one there is.
    with running_cluster(tiny_model_path, tmp_path_factory.mktemp("worker-down"), 2,
                         "least_load") as cluster:
        yield cluster


def _complete_all(url: str, n: int) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    for i in range(n):
        reply = client.completions.create(model=model, prompt=[7, 8, 9 + i], max_tokens=4,
                                          temperature=0.0, extra_body={"ignore_eos": True})
        assert reply.choices[0].finish_reason == "length"


def test_streams_finish_on_the_other_engine_and_routing_waits_for_the_worker(
        pair: Cluster) -> None:
    stack = pair.stack
    url = stack.http_url
    reference = greedy_requests(N)
    for t in run(url, reference):
        t.join(120)
    assert [s.error for s in reference] == [None] * N
    assert all(s.usage == (len(s.prompt), MAX_TOKENS) for s in reference)

    victim = stack.target(stack.engine_key("scheduler", VICTIM))
    worker_key = stack.engine_key("worker", VICTIM)

    def gateway(name: str, **labels: str) -> float:
        return metric(scrape(url + "/metrics"), name, **labels)

    def routed_to_victim() -> float:
        return gateway("minisgl_gateway_routed_requests_total", engine=victim)

    streams = greedy_requests(N)
    threads = run(url, streams)
    wait_until(lambda: all(s.chunks >= 2 for s in streams), 60, "every stream to start")
    assert pair.load(stack.engine_key("scheduler", VICTIM)).running_requests >= 1, \
        "the victim finished before the kill"
    os.kill(stack.processes[worker_key].pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert all(s.done.is_set() for s in streams), "a stream hung after the worker died"
    assert [s.error for s in streams] == [None] * N
    for got, want in zip(streams, reference, strict=True):
        assert (got.finish, got.usage, got.text) == (want.finish, want.usage, want.text)
    after = scrape(url + "/metrics")
    assert metric(after, "minisgl_gateway_migrations_total", outcome="resumed") >= 1
    assert metric(after, "minisgl_gateway_migrations_total", outcome="failed") == 0

    # The worker stays down: the engine is out of routing, and every request goes elsewhere.
    wait_until(lambda: gateway("minisgl_gateway_engine_up", engine=victim) == 0, 10,
               "the gateway to take the worker-less engine out of routing")
    before = routed_to_victim()
    _complete_all(url, 6)
    time.sleep(1.5)  # several load reports and idle probes: it stays out
    _complete_all(url, 2)
    assert routed_to_victim() == before

    # The worker is back (a new process on its port): the engine takes requests again.
    stack._spawn("worker", worker_key)
    stack._wait(worker_key, stack.target(worker_key), time.monotonic() + 120)
    wait_until(lambda: gateway("minisgl_gateway_engine_up", engine=victim) == 1, 30,
               "the engine back in routing once its worker is")
    _complete_all(url, 6)
    assert routed_to_victim() > before
