"""Mid-stream migration over real processes: two engines behind the gateway, N concurrent
streams (greedy and seeded sampling), one engine's scheduler and worker (or only its worker: its
scheduler then fails the requests UNAVAILABLE) SIGKILLed while every stream is under way. No
request fails, and every client sees exactly the text and usage of a fault-free run of the same
requests: the lost engine's sequences continue on the other from the tokens they had streamed.

N is modest for two CPU cores; the same test with N in the hundreds is for a bigger machine."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from .cluster import Cluster, metric, running_cluster, scrape, wait_until
from .streams import MAX_TOKENS, requests, run

N = int(os.environ.get("MINISGL_MIGRATION_STREAMS", "16"))
VICTIM = 1


@pytest.fixture
def pair(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tiny_model_path, tmp_path_factory.mktemp("migration"), 2,
                         "round_robin") as cluster:
        yield cluster


@pytest.mark.parametrize("victims", [("scheduler", "worker"), ("worker",)],
                         ids=["engine", "worker"])
def test_streams_continue_identically_when_an_engine_dies(pair: Cluster,
                                                          victims: tuple[str, ...]) -> None:
    stack = pair.stack
    reference = requests(N)
    for t in run(stack.http_url, reference):
        t.join(120)
    assert all(s.error is None for s in reference), [s.error for s in reference]
    assert all(s.usage is not None and s.usage[0] == len(s.prompt) for s in reference)
    assert all(s.usage == (len(s.prompt), MAX_TOKENS) for s in reference
               if "guided_regex" not in s.params)

    before = scrape(stack.http_url + "/metrics")
    streams = requests(N)
    threads = run(stack.http_url, streams)
    victim = stack.engine_key("scheduler", VICTIM)
    # Every stream has tokens, and the victim is still generating for some of them.
    wait_until(lambda: all(s.chunks >= 2 for s in streams), 60, "every stream to start")
    assert pair.load(victim).running_requests >= 1, "the victim finished before the kill"
    for name in victims:
        os.kill(stack.processes[stack.engine_key(name, VICTIM)].pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert all(s.done.is_set() for s in streams), "a stream hung after the engine died"
    assert [s.error for s in streams] == [None] * N
    for got, want in zip(streams, reference, strict=True):
        assert got.finish == want.finish
        assert got.usage == want.usage  # the original prompt; every output counted once
        assert got.text == want.text, (got.params, got.text, want.text)
    after = scrape(stack.http_url + "/metrics")
    resumed = (metric(after, "minisgl_gateway_migrations_total", outcome="resumed")
               - metric(before, "minisgl_gateway_migrations_total", outcome="resumed"))
    assert resumed >= 1
    assert metric(after, "minisgl_gateway_migrations_total", outcome="failed") == 0
