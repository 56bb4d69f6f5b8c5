"""Helpers for the scheduler tests: drive a Scheduler over the fake GPU and gather its events."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl_scheduler import FinishReason, Scheduler, SchedulerError, TokenEvent


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    error: SchedulerError | None = None
    events: int = 0
    cached_tokens: int = 0


class Recorder:
    """Accumulates events per rid and checks the event stream itself is well formed."""

    def __init__(self) -> None:
        self.out: dict[int, Outcome] = {}

    def add(self, events: list[TokenEvent]) -> None:
        seen = set()
        for ev in events:
            assert ev.rid not in seen, "two events for one request in one step"
            seen.add(ev.rid)
            o = self.out.setdefault(ev.rid, Outcome())
            assert o.finish is None, f"request {ev.rid} got an event after it finished"
            o.tokens += ev.token_ids
            o.events += 1
            o.cached_tokens = ev.cached_tokens
            if ev.finish_reason is not None:
                o.finish, o.error = ev.finish_reason, ev.error


def run(sched: Scheduler, rec: Recorder | None = None, check: bool = True,
        max_steps: int = 1_000_000) -> Recorder:
    rec = rec or Recorder()
    for _ in range(max_steps):
        if not sched.has_work():
            return rec
        rec.add(sched.step())
        if check:
            sched.check_invariants()
    raise AssertionError("scheduler did not finish")


def assert_all_pages_back(sched: Scheduler) -> None:
    """After every request ended: free + evictable cached pages == pool, and eviction empties it."""
    st = sched.stats()
    assert st.running == st.waiting == st.inflight_steps == 0
    assert st.free_pages + st.cached_pages == st.total_pages, st
    assert st.used_pages == 0
    sched.check_invariants()
    sched.kv.drop_cache()
    assert sched.kv.free_pages == st.total_pages
