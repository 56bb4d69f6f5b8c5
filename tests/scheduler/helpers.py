"""Helpers for the scheduler tests: drive a Scheduler and gather its events; a Connect client."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from minisgl_core.convert import sampling_to_proto
from minisgl_core.proto.minisgl.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from minisgl_core.sampling import SamplingParams
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
    if sched.kv.windowed:  # nothing in flight: every window page is back too
        sched.kv.collected(sched._next_step)
        assert sched.kv.win_available == sched.kv.window_pages




class Conn:
    """One Connect stream driven from the test."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self.requests: queue.Queue = queue.Queue()
        self.call = stub.Connect(self._iter(), timeout=30)
        self.tokens: dict[int, list[int]] = {}
        self.final: dict[int, scheduler_pb2.TokenUpdate] = {}
        self.responses = 0

    def _iter(self) -> Iterator[scheduler_pb2.ConnectRequest]:
        while (item := self.requests.get()) is not None:
            yield item

    def send(self, submits: list[tuple[int, list[int], SamplingParams]] = (),  # type: ignore[assignment]
             aborts: list[int] = ()) -> None:  # type: ignore[assignment]
        self.requests.put(scheduler_pb2.ConnectRequest(
            submits=[scheduler_pb2.SubmitItem(rid=rid, input_ids=ids,
                                              sampling=sampling_to_proto(sp))
                     for rid, ids, sp in submits],
            aborts=list(aborts)))

    def read_until(self, done: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "timed out waiting for updates"
            resp = next(self.call)
            self.responses += 1
            rids = [u.rid for u in resp.updates]
            assert len(rids) == len(set(rids)), "one update per request per step"
            for u in resp.updates:
                assert u.rid not in self.final, "update after the final one"
                self.tokens.setdefault(u.rid, []).extend(u.token_ids)
                if u.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    self.final[u.rid] = u
