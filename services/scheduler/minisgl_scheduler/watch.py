"""The `Watch` stream: an engine's load and its prefix-cache events, for the gateways that route.

A stream starts with a snapshot of the cache (or replays from `resume_after` while the event log
still holds it), then sends every cache batch the loop flushes, numbered, and load reports: every
`load_interval_s`, and soon after the running or waiting count changes (`LOAD_CHANGE_GAP_S` after
the last report at the earliest).

Between messages a stream sleeps on `Changes` until the loop says something changed or its next
load report is due, whichever comes first. A wake-up is only a reason to look: what is sent is
decided by the event log and `LoadSchedule`, so waking for nothing sends nothing.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

from minisgl_core.proto.minisgl.v1 import scheduler_pb2

from minisgl_scheduler.prefix_events import PrefixEventLog
from minisgl_scheduler.radix import RadixCache
from minisgl_scheduler.stats import SchedulerStats

DEFAULT_LOAD_INTERVAL_S = 0.1  # between load reports when the caller does not say
MIN_LOAD_INTERVAL_S = 0.02
# A change of running/waiting is reported this soon (at most this often), between the periodic
# reports. A router's picture of a saturated engine is only as fresh as its last report: when a
# batch of requests ends, the slots they free must be seen before new requests queue elsewhere
# behind a whole generation.
LOAD_CHANGE_GAP_S = 0.01

T = TypeVar("T")
# (running, waiting, worker down): what a load change is. A worker that dies or comes back is
# reported as soon as a new count would be: routers must stop (or resume) sending at once.
Counts = tuple[int, ...]


class OnLoop(Protocol):
    """Runs `fn` on the loop thread and returns its result (`SchedulerLoop.call`)."""

    def __call__(self, fn: Callable[[], T], timeout: float = ...) -> T: ...


class Changes:
    """How many times the loop said "look again" (a cache batch, a new running/waiting count, a
    stop, a stream that ended), with a wait for the next time.

    A counter rather than an Event: a stream that was busy sending when it moved still sees it on
    its next wait, and nobody has to clear it for the others.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    def notify(self) -> None:
        with self._cond:
            self._count += 1
            self._cond.notify_all()

    def wait(self, seen: int, timeout: float) -> int:
        """Until the count is past `seen` or `timeout` seconds passed; the count then."""
        with self._cond:
            if timeout > 0:
                self._cond.wait_for(lambda: self._count != seen, timeout)
            return self._count


@dataclass(slots=True)
class LoadSchedule:
    """When one stream's load reports are due: periodically, and on a change of the counts no
    sooner than `gap` after the last report."""

    interval: float
    next_periodic: float
    gap: float = LOAD_CHANGE_GAP_S
    sent: Counts = (-1, -1)  # the counts of the last report (none yet: differs from any)
    last: float = -math.inf  # when it went

    @classmethod
    def asked(cls, load_interval_s: float, now: float) -> LoadSchedule:
        """The interval a caller asked for (0: the default), clamped; the first report is due now."""
        return cls(max(MIN_LOAD_INTERVAL_S, load_interval_s or DEFAULT_LOAD_INTERVAL_S), now)

    def due(self, counts: Counts) -> float:
        """When the next report is due, given the counts now."""
        if counts != self.sent:
            return min(self.next_periodic, self.last + self.gap)
        return self.next_periodic

    def take(self, counts: Counts, now: float) -> bool:
        """Whether a report of `counts` goes out at `now`; if so it is recorded as sent."""
        periodic = now >= self.next_periodic
        if not periodic and (counts == self.sent or now < self.last + self.gap):
            return False
        self.sent, self.last = counts, now
        if periodic:  # late (a slow reader) does not bunch up: the next one is an interval on
            self.next_periodic = max(self.next_periodic + self.interval, now)
        return True


@dataclass
class WatchStream:
    """One Watch call. Everything it reads is safe from a gRPC thread; what must not race the
    step (subscribing, snapshots of the tree) runs on the loop through `on_loop`."""

    events: PrefixEventLog
    changes: Changes
    on_loop: OnLoop
    # The prefix cache now: a restarted worker comes with a new one (a stream outlives it).
    cache: Callable[[], RadixCache | None]
    stats: Callable[[], SchedulerStats]  # the loop's latest snapshot
    load: Callable[[SchedulerStats], scheduler_pb2.EngineLoad]
    clock: Callable[[], float] = time.monotonic

    def run(self, request: scheduler_pb2.WatchRequest,
            alive: Callable[[], bool]) -> Iterator[scheduler_pb2.WatchResponse]:
        events, changes, cache = self.events, self.changes, self.cache
        page_size = events.page_size
        seen = changes.count
        sub = self.on_loop(lambda: events.subscribe(request.resume_after, cache()))
        try:
            cursor = sub.cursor
            if sub.snapshot is not None:
                yield scheduler_pb2.WatchResponse(seq=cursor, snapshot=True, stored=sub.snapshot,
                                                  window_stored=sub.window_snapshot or (),
                                                  load=self.load(self.stats()),
                                                  page_size=page_size, window=self._window())
            reports = LoadSchedule.asked(request.load_interval_s, self.clock())
            while alive():
                s = self.stats()
                seen = changes.wait(seen, reports.due(_counts(s)) - self.clock())
                batches = events.since(cursor, 0.0)
                if batches is None:  # fell out of the ring: start over from the whole tree
                    cursor, hashes, win = self.on_loop(lambda: events.snapshot(cache()))
                    yield scheduler_pb2.WatchResponse(seq=cursor, snapshot=True, stored=hashes,
                                                      window_stored=win or (),
                                                      page_size=page_size, window=self._window())
                    continue
                for batch in batches:
                    cursor = batch.seq
                    yield scheduler_pb2.WatchResponse(
                        seq=cursor, stored=batch.stored, removed=batch.removed,
                        window_stored=batch.window_stored, window_removed=batch.window_removed,
                        page_size=page_size, window=self._window())
                s = self.stats()
                if reports.take(_counts(s), self.clock()):
                    yield scheduler_pb2.WatchResponse(seq=cursor, load=self.load(s),
                                                      page_size=page_size, window=self._window())
        finally:
            events.unsubscribe()

    def _window(self) -> int:
        """The engine's sliding window in tokens when its cache keeps a window pool, else 0."""
        cache = self.cache()
        return cache.window if cache is not None else 0


def _counts(s: SchedulerStats) -> Counts:
    return s.running, s.waiting, int(s.worker_down)
