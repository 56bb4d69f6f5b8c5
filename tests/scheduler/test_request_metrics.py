"""`RequestClock`, the per-request metrics the serving loop feeds with one call per token event:
time to first token, inter-token latency (tokens that came together share the gap), the phases,
end-to-end latency, token counts and finish reasons, against a clock the test sets."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
from minisgl_core.sampling import SamplingParams
from minisgl_scheduler import FinishReason, Scheduler, TokenEvent
from minisgl_scheduler.request_metrics import RequestClock

from .fake_executor import FakeExecutor


class Series:
    """A histogram or counter child that remembers what it was given."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, v: float) -> None:
        self.values.append(v)

    def inc(self, v: float = 1.0) -> None:
        self.values.append(v)


class Metrics:
    def __init__(self) -> None:
        self.series: dict[str, Series] = defaultdict(Series)
        self.by_reason: dict[str, Series] = defaultdict(Series)

    def __getattr__(self, name: str) -> Series:
        return self.series[name]

    def finished(self, reason: str) -> Series:
        return self.by_reason[reason]


def _clock(now: list[float]) -> tuple[RequestClock, Metrics, Scheduler]:
    sched = Scheduler(FakeExecutor(num_pages=64, page_size=4, max_slots=8, max_model_len=256))
    m = Metrics()
    clock = RequestClock(m, sched)  # type: ignore[arg-type]  # duck-typed series
    clock.now = lambda: now[0]
    return clock, m, sched


def test_ttft_then_itl_per_token_then_the_end() -> None:
    now = [0.0]
    clock, m, sched = _clock(now)
    sched.submit(1, [1, 2, 3], SamplingParams(max_tokens=10))
    clock.submitted(1, 100.0, 3, 10)
    now[0] = 100.5
    clock.event(TokenEvent(1, token_ids=[7]))
    now[0] = 100.9
    clock.event(TokenEvent(1, token_ids=[8, 9]))  # two tokens in one event: two gaps of 0.2
    now[0] = 101.0
    clock.event(TokenEvent(1, token_ids=[10], finish_reason=FinishReason.LENGTH))
    s: dict[str, Any] = {k: v.values for k, v in m.series.items()}
    assert s["ttft"] == [0.5]
    assert s["itl"] == pytest.approx([0.2, 0.2, 0.1])
    assert s["generation_tokens"] == [1, 2, 1] and s["prompt_tokens"] == [3]
    assert s["e2e"] == [1.0] and s["generation_len"] == [4] and s["prompt_len"] == [3]
    assert s["decode"] == pytest.approx([0.5])
    assert s["tpot"] == pytest.approx([0.5 / 3])
    assert m.by_reason["length"].values == [1.0]


def test_an_event_without_tokens_only_ends_the_request() -> None:
    now = [0.0]
    clock, m, _ = _clock(now)
    clock.submitted(1, 0.0, 3, 10)
    now[0] = 2.0
    clock.event(TokenEvent(1, finish_reason=FinishReason.ABORT))
    assert "ttft" not in m.series and "itl" not in m.series and "generation_tokens" not in m.series
    assert m.series["e2e"].values == [2.0] and m.by_reason["abort"].values == [1.0]


def test_a_refused_submit_counts_as_an_error_and_a_forgotten_one_not_at_all() -> None:
    clock, m, _ = _clock([0.0])
    clock.refused()
    assert m.by_reason["error"].values == [1.0]
    clock.submitted(2, 0.0, 3, 10)
    clock.forget(2)  # its connection went away
    clock.event(TokenEvent(2, token_ids=[5]))
    assert "ttft" not in m.series and "generation_tokens" not in m.series


class _LoopMetrics(Metrics):
    """What the serving loop also calls: the per-iteration gauges."""

    def update(self, stats: object) -> None:
        pass


def test_a_failed_loop_iteration_releases_the_clocks_of_the_requests_it_fails() -> None:
    """A bug in the step path fails every request in flight (never a hang); their clocks must go
    with them, as a finished request's do, or each such failure leaks one entry per request."""
    from minisgl_scheduler.commands import Batch, Submit
    from minisgl_scheduler.connection import Conn
    from minisgl_scheduler.loop import SchedulerLoop

    sched = Scheduler(FakeExecutor(num_pages=64, page_size=4, max_slots=8, max_model_len=256))
    m = _LoopMetrics()
    loop = SchedulerLoop(sched, m)  # type: ignore[arg-type]  # duck-typed series
    clock = loop.clock
    assert clock is not None
    real_step, failures = sched.step, [0]

    def step() -> list[TokenEvent]:
        if not failures[0]:
            failures[0] += 1
            raise RuntimeError("a bug in the step path")
        return real_step()

    sched.step = step  # type: ignore[method-assign]
    conn = Conn(1)
    loop.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        loop.put(Batch(conn, submits=(Submit(1, [1, 2, 3], params), Submit(2, [4, 5], params))))
        finals = {}
        while len(finals) < 2:
            reply = conn.outbox.get(timeout=10)
            assert reply is not None
            finals.update({u.rid: u for u in reply.updates if u.finish_reason})
        assert {u.error.message for u in finals.values()} == {"internal scheduler error"}
        assert loop.call(lambda: (dict(clock._live), set(clock._unscheduled))) == ({}, set())
        assert m.by_reason["error"].values == [1.0, 1.0]
        # The loop carries on: the next request is served and its clock released as usual.
        loop.put(Batch(conn, submits=(Submit(3, [1, 2, 3], params),)))
        while 3 not in finals:
            reply = conn.outbox.get(timeout=10)
            assert reply is not None
            finals.update({u.rid: u for u in reply.updates if u.finish_reason})
        assert not finals[3].error.message
        assert loop.call(lambda: dict(clock._live)) == {}
    finally:
        loop.stop()
