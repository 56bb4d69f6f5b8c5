"""The Watch stream's pieces (watch.py) and the RPC over loopback gRPC: a stream sleeps until the
loop reports a change or its next load report is due, whichever comes first; a change is reported
long before the interval the caller asked for, and with nothing changing the reports come at that
interval; cache batches go out as the loop flushes them, numbered."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc
import pytest
from minisgl_core.prefix_hash import page_hashes
from minisgl_core.proto.minisgl.v1 import scheduler_pb2
from minisgl_core.sampling import SamplingParams
from minisgl_scheduler import SchedulerStats
from minisgl_scheduler.prefix_events import EventBatch, PrefixEventLog
from minisgl_scheduler.radix import RadixCache
from minisgl_scheduler.watch import (
    DEFAULT_LOAD_INTERVAL_S,
    LOAD_CHANGE_GAP_S,
    MIN_LOAD_INTERVAL_S,
    Changes,
    LoadSchedule,
    WatchStream,
)

from .helpers import Conn
from .test_server import Stack

T = TypeVar("T")
PS = 4

# -- Changes ---------------------------------------------------------------------------------------


def test_changes_wait_returns_at_once_for_a_change_it_has_not_seen() -> None:
    changes = Changes()
    seen = changes.count
    changes.notify()  # while nobody waited: not lost
    t0 = time.monotonic()
    assert changes.wait(seen, 5.0) == seen + 1
    assert time.monotonic() - t0 < 1.0


def test_changes_wait_times_out_without_a_change() -> None:
    changes = Changes()
    t0 = time.monotonic()
    assert changes.wait(changes.count, 0.05) == 0
    assert time.monotonic() - t0 >= 0.04
    assert changes.wait(0, 0.0) == 0 and changes.wait(0, -1.0) == 0  # due already: no wait


def test_changes_notify_wakes_a_waiter_before_its_timeout() -> None:
    changes = Changes()
    woke: list[float] = []

    def waiter() -> None:
        changes.wait(0, 30.0)
        woke.append(time.monotonic())

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    changes.notify()
    t.join(5.0)
    assert woke and woke[0] - t0 < 1.0


# -- LoadSchedule ----------------------------------------------------------------------------------


def test_load_schedule_interval_asked_defaulted_and_clamped() -> None:
    assert LoadSchedule.asked(0.5, 10.0).interval == 0.5
    assert LoadSchedule.asked(0.0, 10.0).interval == DEFAULT_LOAD_INTERVAL_S
    assert LoadSchedule.asked(0.001, 10.0).interval == MIN_LOAD_INTERVAL_S


def test_load_schedule_reports_periodically_when_nothing_changes() -> None:
    s = LoadSchedule.asked(1.0, 100.0)
    assert s.due((0, 0)) <= 100.0 and s.take((0, 0), 100.0)  # the first report: at once
    assert s.due((0, 0)) == 101.0
    assert not s.take((0, 0), 100.5)  # the same counts: not before the interval
    assert s.take((0, 0), 101.0)
    assert s.due((0, 0)) == 102.0
    assert s.take((0, 0), 105.3)  # a late reader does not get a burst of overdue reports
    assert s.due((0, 0)) == 105.3 and s.take((0, 0), 105.3)
    assert not s.take((0, 0), 105.4)


def test_load_schedule_reports_a_change_soon_but_not_too_often() -> None:
    gap = LOAD_CHANGE_GAP_S
    s = LoadSchedule.asked(60.0, 100.0)
    assert s.take((0, 0), 100.0)
    assert s.due((1, 0)) == 100.0 + gap  # a change: due a gap after the last report
    assert not s.take((1, 0), 100.0 + gap / 2)
    assert s.take((1, 0), 100.0 + gap)
    assert s.due((1, 0)) == 160.0  # reported: the periodic one is next
    assert not s.take((1, 0), 130.0)
    assert s.take((2, 3), 130.0)  # long after the last report: at once
    assert s.next_periodic == 160.0  # a change report does not move the periodic ones


# -- WatchStream over a fake loop ------------------------------------------------------------------


def _stats(running: int = 0, waiting: int = 0) -> SchedulerStats:
    return SchedulerStats(running, waiting, 0, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0, 0)


class FakeLoop:
    """What a WatchStream reads of the loop; the test plays the loop thread."""

    def __init__(self) -> None:
        self.changes = Changes()
        self.events = PrefixEventLog(PS, on_batch=self.changes.notify)
        self.stats = _stats()
        self.stopped = False

    def call(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        return fn()

    def set_load(self, running: int, waiting: int) -> None:
        self.stats = _stats(running, waiting)
        self.changes.notify()

    def cache_pages(self, tokens: list[int]) -> None:
        self.events.stored(tokens, 0)
        self.events.flush()

    def watch(self, interval: float, resume_after: int = 0, cache: RadixCache | None = None
              ) -> tuple[queue.Queue[tuple[float, scheduler_pb2.WatchResponse]], threading.Thread]:
        """Run a stream on its own thread (a gRPC thread's stand-in); its messages, timestamped."""
        stream = WatchStream(self.events, self.changes, self.call, lambda: cache, lambda: self.stats,
                             lambda s: scheduler_pb2.EngineLoad(running_requests=s.running,
                                                                waiting_requests=s.waiting))
        got: queue.Queue[tuple[float, scheduler_pb2.WatchResponse]] = queue.Queue()
        req = scheduler_pb2.WatchRequest(load_interval_s=interval, resume_after=resume_after)

        def run() -> None:
            for msg in stream.run(req, lambda: not self.stopped):
                got.put((time.monotonic(), msg))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return got, t

    def stop(self, t: threading.Thread) -> None:
        self.stopped = True
        self.changes.notify()
        t.join(5.0)
        assert not t.is_alive(), "the stream did not end when woken"


@pytest.fixture
def loop() -> Iterator[FakeLoop]:
    yield FakeLoop()


def test_a_stream_starts_with_a_snapshot_then_a_load_report(loop: FakeLoop) -> None:
    got, t = loop.watch(60.0)
    _, first = got.get(timeout=5)
    assert first.snapshot and first.HasField("load") and list(first.stored) == []
    _, second = got.get(timeout=5)
    assert second.HasField("load") and not second.snapshot and second.seq == first.seq
    assert loop.events.subscribers == 1
    loop.stop(t)
    assert loop.events.subscribers == 0


def test_a_load_change_wakes_the_stream_long_before_its_interval(loop: FakeLoop) -> None:
    got, t = loop.watch(60.0)
    got.get(timeout=5), got.get(timeout=5)  # the snapshot, the first report
    t0 = time.monotonic()
    loop.set_load(3, 1)
    at, msg = got.get(timeout=5)
    assert (msg.load.running_requests, msg.load.waiting_requests) == (3, 1)
    assert at - t0 < 1.0
    loop.set_load(3, 1)  # a wake-up with nothing new: nothing is sent
    with pytest.raises(queue.Empty):
        got.get(timeout=0.2)
    loop.stop(t)


def test_a_cache_batch_wakes_the_stream_and_goes_out_numbered(loop: FakeLoop) -> None:
    got, t = loop.watch(60.0)
    _, first = got.get(timeout=5)
    got.get(timeout=5)
    tokens = list(range(1, 9))  # two pages
    t0 = time.monotonic()
    loop.cache_pages(tokens)
    at, msg = got.get(timeout=5)
    assert at - t0 < 1.0
    assert msg.seq == first.seq + 1 and list(msg.stored) == page_hashes(tokens, PS)
    assert not msg.HasField("load")  # the load did not change: no report with it
    loop.stop(t)


def test_with_nothing_changing_reports_come_at_the_interval(loop: FakeLoop) -> None:
    interval = 0.05
    got, t = loop.watch(interval)
    start, _ = got.get(timeout=5)  # the snapshot: the schedule starts after it
    times = [got.get(timeout=5)[0] for _ in range(6)]
    loop.stop(t)
    # Report k is due `k` intervals after the start (a late one does not push the later ones).
    assert all(at >= start + k * interval for k, at in enumerate(times)), (start, times)
    assert times[-1] - start < 5 * interval + 1.0  # no wake-up waited for a change


def test_an_idle_stream_sleeps_instead_of_polling(loop: FakeLoop) -> None:
    looks = [0]
    real = loop.events.since

    def counted(cursor: int, timeout: float) -> list[EventBatch] | None:
        looks[0] += 1
        return real(cursor, timeout)

    loop.events.since = counted  # type: ignore[method-assign]
    got, t = loop.watch(60.0)
    got.get(timeout=5), got.get(timeout=5)
    before = looks[0]
    time.sleep(0.3)
    assert looks[0] - before <= 1  # asleep until a change or its report a minute away
    loop.stop(t)


def test_a_windowed_cache_reports_its_window_and_window_pages(loop: FakeLoop) -> None:
    """An engine with sliding-window layers says its window on every message and which cached
    pages keep window KV: in the snapshot, as pages come, and as window KV alone is evicted."""
    cache = RadixCache(PS, windowed=True, window=6)
    cache.listener = loop.events
    tokens = list(range(3 * PS))
    cache.insert(tokens[:PS], [0], win=[5])  # cached before the stream: in its snapshot
    hashes = page_hashes(tokens, PS)
    got, t = loop.watch(60.0, cache=cache)
    _, first = got.get(timeout=5)
    assert first.snapshot and first.window == 6
    assert list(first.stored) == hashes[:1] and list(first.window_stored) == hashes[:1]
    cache.insert(tokens, [0, 1, 2], win=[5, -1, 7])  # page 1's window KV already dropped
    loop.events.flush()
    msg = _next_batch(got)
    assert set(msg.stored) == set(hashes[1:]) and list(msg.window_stored) == hashes[2:]
    assert msg.window == 6
    assert sorted(cache.evict_window(2)) == [5, 7]
    loop.events.flush()
    msg = _next_batch(got)
    assert set(msg.window_removed) == {hashes[0], hashes[2]} and not msg.removed
    loop.stop(t)


def _next_batch(got: queue.Queue[tuple[float, scheduler_pb2.WatchResponse]]
                ) -> scheduler_pb2.WatchResponse:
    while True:
        _, msg = got.get(timeout=5)
        if msg.seq and not msg.HasField("load"):
            return msg


def test_a_stream_that_fell_behind_the_ring_gets_a_snapshot(loop: FakeLoop) -> None:
    loop.events = PrefixEventLog(PS, ring_batches=2, on_batch=loop.changes.notify)
    got, t = loop.watch(60.0)
    _, first = got.get(timeout=5)
    got.get(timeout=5)
    gate = threading.Event()
    real = loop.events.since

    def held(cursor: int, timeout: float) -> list[EventBatch] | None:
        gate.wait(5)
        return real(cursor, timeout)

    loop.events.since = held  # type: ignore[method-assign]
    for i in range(4):  # more batches than the ring holds, while the stream is held
        loop.cache_pages([10 * i + k for k in range(1, 5)])
    gate.set()
    _, msg = got.get(timeout=5)
    assert msg.snapshot and msg.seq == first.seq + 4 and not msg.HasField("load")
    loop.stop(t)


# -- the RPC ---------------------------------------------------------------------------------------


@pytest.fixture
def stack() -> Iterator[Stack]:
    s = Stack(step_delay=0.01, cache="radix")
    yield s
    s.close()


def _reader(call: Iterator[scheduler_pb2.WatchResponse]
            ) -> queue.Queue[tuple[float, scheduler_pb2.WatchResponse]]:
    got: queue.Queue[tuple[float, scheduler_pb2.WatchResponse]] = queue.Queue()

    def read() -> None:
        try:
            for msg in call:
                got.put((time.monotonic(), msg))
        except grpc.RpcError:
            pass  # cancelled by the test

    threading.Thread(target=read, daemon=True).start()
    return got


def test_watch_rpc_reports_a_request_starting_before_its_interval(stack: Stack) -> None:
    call = stack.stub.Watch(scheduler_pb2.WatchRequest(load_interval_s=60.0), timeout=30)
    got = _reader(call)
    _, first = got.get(timeout=5)
    assert first.snapshot and first.page_size == 4 and first.load.max_running_requests == 8
    assert first.load.watchers == 1
    got.get(timeout=5)  # the first periodic report
    conn = Conn(stack.stub)
    t0 = time.monotonic()
    conn.send([(1, [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=30,
                                                   ignore_eos=True))])
    busy = None
    stored: set[int] = set()
    while busy is None:
        at, msg = got.get(timeout=5)
        stored |= set(msg.stored)
        if msg.HasField("load") and msg.load.running_requests + msg.load.waiting_requests:
            busy = at
    assert busy - t0 < 5.0  # not the minute it asked for
    conn.read_until(lambda: 1 in conn.final)
    while not (msg.HasField("load") and msg.load.running_requests == 0):
        _, msg = got.get(timeout=5)
        stored |= set(msg.stored)
    assert page_hashes([1, 2, 3, 4], 4)[0] in stored  # the prompt's whole page is cached
    call.cancel()
    conn.call.cancel()


def test_watch_rpc_reports_at_its_interval_when_idle(stack: Stack) -> None:
    interval = 0.1
    call = stack.stub.Watch(scheduler_pb2.WatchRequest(load_interval_s=interval), timeout=30)
    got = _reader(call)
    got.get(timeout=5)
    msgs = [got.get(timeout=5) for _ in range(5)]
    assert all(m.HasField("load") and not m.stored and not m.removed for _, m in msgs)
    assert len({m.seq for _, m in msgs}) == 1
    # The first report is due at the start, the fifth four intervals on: not a burst, whatever
    # the delivery delays.
    assert msgs[-1][0] - msgs[0][0] >= 2 * interval
    call.cancel()


def test_a_cancelled_watch_lets_go_before_its_interval(stack: Stack) -> None:
    events = stack.service.loop.events
    call = stack.stub.Watch(scheduler_pb2.WatchRequest(load_interval_s=60.0), timeout=30)
    got = _reader(call)
    got.get(timeout=5), got.get(timeout=5)  # the snapshot, the first report: now it sleeps
    assert events.subscribers == 1
    call.cancel()
    deadline = time.monotonic() + 5
    while events.subscribers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events.subscribers == 0  # woken by the RPC's end, not at its next report
