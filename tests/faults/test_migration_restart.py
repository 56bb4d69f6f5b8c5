"""Mid-stream migration to the same engine: the only scheduler (or only its worker) is SIGKILLed
while streams (greedy and seeded sampling) are under way and started again; the gateway holds the
streams (up to --migration-wait) until it is back, and every client sees exactly the fault-free
text and usage. With the worker killed the scheduler stays up and says its worker is down: the
streams wait for it rather than go back to the engine at once, fail there again and use up their
migration attempts in a second (the compose worker-crash test saw 2 of 5 streams finish)."""

from __future__ import annotations

import time

import pytest

from tests.gateway.live_stack import wait_for
from tests.routing.streams import MAX_TOKENS, requests, run

from .chaos import Chaos

N = 6
DOWN_S = 3.0  # a real restart takes a while (a container's restart delay, loading the model)

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("victim", ["scheduler", "worker"])
def test_streams_wait_for_their_restarted_engine_and_continue_identically(chaos: Chaos,
                                                                          victim: str) -> None:
    reference = requests(N)
    for t in run(chaos.http_url, reference):
        t.join(120)
    assert all(s.error is None for s in reference), [s.error for s in reference]
    assert all(s.usage is not None and s.usage[0] == len(s.prompt) for s in reference)
    assert all(s.usage == (len(s.prompt), MAX_TOKENS) for s in reference
               if "guided_regex" not in s.params)

    streams = requests(N)
    threads = run(chaos.http_url, streams)
    wait_for(lambda: all(s.chunks >= 2 for s in streams), 60, "every stream to start")
    assert sum(not s.done.is_set() for s in streams) >= N // 2, "streams ended before the kill"
    chaos.kill(victim)
    time.sleep(DOWN_S)
    chaos.start(victim)
    for t in threads:
        t.join(120)
    assert [s.error for s in streams] == [None] * N
    for got, want in zip(streams, reference, strict=True):
        assert got.finish == want.finish
        assert got.usage == want.usage
        assert got.text == want.text, (got.params, got.text, want.text)
