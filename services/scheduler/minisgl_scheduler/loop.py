"""The serving loop: one thread owns the `Scheduler` and talks to gRPC threads only by messages.

gRPC threads never touch the scheduler: they put commands (commands.py) in the inbox, which the
loop drains before each step. After each step every connection gets one ConnectResponse holding
all of its TokenUpdates, the prefix-cache events of the iteration become one batch, and the load
snapshot that GetLoad and Watch read is replaced. Client rids are per connection; the loop maps
them to unique scheduler rids. While there is nothing to do, the loop asks every `PROBE_S` whether
the worker is there (`Scheduler.probe_worker`), so that a worker that died or came back while the
engine was idle shows in the load reports routers read.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar, assert_never

from minisgl_core.proto.minisgl.v1 import common_pb2, scheduler_pb2

from minisgl_scheduler.commands import Batch, Call, Command, Drop, HalfClose, Open, Submit, Wake
from minisgl_scheduler.connection import Conn, Owner
from minisgl_scheduler.convert import FINISH_TO_PROTO, error_to_proto, token_update
from minisgl_scheduler.errors import ErrorCode, SchedulerError
from minisgl_scheduler.metrics import SchedulerMetrics
from minisgl_scheduler.prefix_events import PrefixEventLog
from minisgl_scheduler.request import FinishReason, TokenEvent
from minisgl_scheduler.request_metrics import RequestClock
from minisgl_scheduler.scheduler import Scheduler
from minisgl_scheduler.watch import Changes

log = logging.getLogger(__name__)

T = TypeVar("T")
PROBE_S = 0.5  # between worker checks while idle (free while a healthy step stream is open)
_Out = dict[Conn, list[scheduler_pb2.TokenUpdate]]  # token updates per connection, one pass


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, metrics: SchedulerMetrics | None = None) -> None:
        self.sched = scheduler
        self.metrics = metrics
        self.clock = RequestClock(metrics, scheduler) if metrics else None
        self.draining = False  # set by the service (SIGTERM): submits are refused
        self.stats = scheduler.stats()  # the latest snapshot, replaced after each iteration
        self.changes = Changes()  # told when Watch streams have something to look at
        self.events = PrefixEventLog(scheduler.info.page_size, on_batch=self.changes.notify)
        scheduler.cache_listener = self.events  # also the cache of a restarted worker
        self._inbox: queue.Queue[Command] = queue.Queue()
        self._owners: dict[int, Owner] = {}  # scheduler rid -> who asked (loop thread only)
        self._conns: set[Conn] = set()
        self._rids = itertools.count(1)
        self._next_probe = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduler-loop", daemon=True)

    # -- from other threads ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def put(self, cmd: Command) -> None:
        self._inbox.put(cmd)

    def call(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """Run `fn` on the loop thread (the only one that touches the scheduler)."""
        fut: Future[Any] = Future()
        self._inbox.put(Call(fn, fut))
        result: T = fut.result(timeout=timeout)
        return result

    def idle(self) -> bool:
        """Nothing live and nothing to do (loop thread: through `call`)."""
        return not self._owners and not self.sched.has_work()

    def stop(self) -> None:
        """End the loop, then every stream: Connect streams end, Watch streams wake and see it."""
        if self._thread.is_alive():
            self._stop.set()
            self._inbox.put(Wake())
            self._thread.join(timeout=10)
        for conn in list(self._conns):
            conn.outbox.put(None)
        self.changes.notify()
        self.sched.close()

    # -- the loop thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            out: _Out = defaultdict(list)
            try:
                self._take_commands(out, block=not self.sched.has_work())
                if self.sched.has_work():
                    t0 = time.monotonic()
                    events = self.sched.step()
                    if self.metrics and self.clock:
                        t1 = time.monotonic()
                        self.metrics.step_time.observe(t1 - t0)
                        self.clock.after_step(t1)
                    for ev in events:
                        self._route(ev, out)
                elif (now := time.monotonic()) >= self._next_probe:
                    self._next_probe = now + PROBE_S
                    for ev in self.sched.probe_worker():
                        self._route(ev, out)
            except Exception:  # a bug: fail what is in flight rather than hang the clients
                log.exception("scheduler loop iteration failed")
                self._fail_all(out)
                time.sleep(0.1)  # do not spin if the failure repeats
            for conn, updates in out.items():
                if not conn.ended:
                    conn.outbox.put(scheduler_pb2.ConnectResponse(updates=updates))
            for conn in [c for c in self._conns if c.half_closed and not c.rids]:
                self._end(conn)
            self.events.flush()
            before, self.stats = self.stats, self.sched.stats()
            if ((before.running, before.waiting, before.worker_down)
                    != (self.stats.running, self.stats.waiting, self.stats.worker_down)):
                self.changes.notify()  # Watch streams report the new load
            if self.metrics:
                self.metrics.update(self.stats)

    def _take_commands(self, out: _Out, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd, out)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: Command, out: _Out) -> None:
        match cmd:
            case Batch():
                self._batch(cmd, out)
            case Open():
                self._conns.add(cmd.conn)
            case HalfClose():
                cmd.conn.half_closed = True
            case Drop():
                self._drop(cmd.conn)
            case Call():
                cmd.run()
            case Wake():
                pass
            case _:
                assert_never(cmd)

    def _batch(self, cmd: Batch, out: _Out) -> None:
        conn = cmd.conn
        if conn.ended:
            return
        for item in cmd.submits:
            self._submit(conn, item, out)
        for client_rid in cmd.aborts:
            rid = conn.rids.get(client_rid)
            if rid is not None:
                self.sched.abort(rid)
        for client_rid in cmd.stops:  # a stop string matched downstream
            rid = conn.rids.get(client_rid)
            if rid is not None:
                self.sched.abort(rid, FinishReason.STOP)

    def _submit(self, conn: Conn, item: Submit, out: _Out) -> None:
        rid = next(self._rids)
        try:
            if self.draining:
                raise SchedulerError("the scheduler is shutting down", ErrorCode.UNAVAILABLE)
            if item.rid in conn.rids:
                raise SchedulerError(f"request id {item.rid} is already live on this connection",
                                     ErrorCode.INVALID_ARGUMENT)
            self.sched.submit(rid, item.input_ids, item.params, item.cache_salt,
                              item.num_prompt_tokens, item.priority, item.tenant)
            if item.traceparent or item.request_id:
                self.sched.traces.add(self.sched.reqs[rid], item.traceparent, item.request_id)
        except SchedulerError as exc:
            out[conn].append(scheduler_pb2.TokenUpdate(
                rid=item.rid, finish_reason=common_pb2.FINISH_REASON_ERROR,
                error=error_to_proto(exc),
                prompt_tokens=item.num_prompt_tokens or len(item.input_ids)))
            if self.clock:
                self.clock.refused()
            return
        conn.rids[item.rid] = rid
        self._owners[rid] = Owner(conn, item.rid)
        if self.clock:
            self.clock.submitted(rid, time.monotonic(), len(item.input_ids),
                                 item.params.max_tokens)

    def _route(self, ev: TokenEvent, out: _Out) -> None:
        owner = self._owners.get(ev.rid)
        if owner is None:
            return  # its connection is gone
        if self.clock:
            self.clock.event(ev)
        out[owner.conn].append(token_update(owner.client_rid, ev))
        if ev.finish_reason is not None:
            del self._owners[ev.rid]
            owner.conn.rids.pop(owner.client_rid, None)

    def abort_any(self, client_rids: set[int]) -> int:
        """Unary Abort: the rids of whichever connection holds them (loop thread: through
        `call`)."""
        n = 0
        for conn in list(self._conns):
            for client_rid in client_rids & conn.rids.keys():
                n += self.sched.abort(conn.rids[client_rid])
        return n

    def _drop(self, conn: Conn) -> None:
        """The client went away: abort everything it submitted, nothing more is sent to it."""
        for rid in conn.rids.values():
            self.sched.abort(rid)
            self._owners.pop(rid, None)
            if self.clock:
                self.clock.forget(rid)
        if conn.rids:
            log.info("connection %d dropped; aborted %d requests", conn.id, len(conn.rids))
        conn.rids.clear()
        self._end(conn)

    def _end(self, conn: Conn) -> None:
        conn.ended = True
        conn.outbox.put(None)
        self._conns.discard(conn)

    def _fail_all(self, out: _Out) -> None:
        error = SchedulerError("internal scheduler error")
        now = time.monotonic()
        for rid, owner in list(self._owners.items()):
            if self.clock:  # they end here: no event of theirs will reach `_route`
                self.clock.finished(rid, FinishReason.ERROR, now)
            out[owner.conn].append(scheduler_pb2.TokenUpdate(
                rid=owner.client_rid, finish_reason=FINISH_TO_PROTO[FinishReason.ERROR],
                error=error_to_proto(error)))
            owner.conn.rids.pop(owner.client_rid, None)
            try:
                self.sched.abort(rid)
            except Exception:
                log.exception("abort of %d failed", rid)
        self._owners.clear()
