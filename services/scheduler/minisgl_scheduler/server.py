"""The `minisgl.v1.Scheduler` gRPC service: a thin adapter over `Scheduler`.

One loop thread owns the Scheduler. gRPC threads never touch it: they post commands (batched
submits/aborts of a Connect stream, a dropped stream, a unary Abort) to an inbox that the loop drains
before each step. After each step every connection gets one ConnectResponse holding all of its
TokenUpdates. Client rids are per connection; the loop maps them to unique scheduler rids.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc
from minisgl_core.convert import sampling_from_proto
from minisgl_core.proto.minisgl.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

from minisgl_scheduler.convert import FINISH_TO_PROTO, error_to_proto
from minisgl_scheduler.errors import ErrorCode, SchedulerError
from minisgl_scheduler.metrics import SchedulerMetrics
from minisgl_scheduler.prefix_events import PrefixEventLog
from minisgl_scheduler.request import FinishReason, TokenEvent
from minisgl_scheduler.request_metrics import RequestClock
from minisgl_scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)

DEFAULT_LOAD_INTERVAL_S = 0.1  # Watch: between load reports when the caller does not say
MIN_LOAD_INTERVAL_S = 0.02
# Watch: a change of running/waiting is reported this soon (at most this often), between the
# periodic reports. A router's picture of a saturated engine is only as fresh as its last report:
# when a batch of requests ends, the slots they free must be seen before new requests queue
# elsewhere behind a whole generation.
LOAD_CHANGE_GAP_S = 0.01


@dataclass(eq=False)
class _Conn:
    id: int
    outbox: queue.Queue[Any] = field(default_factory=queue.Queue)  # ConnectResponse | None (end)
    rids: dict[int, int] = field(default_factory=dict)  # client rid -> scheduler rid
    half_closed: bool = False  # the client sends no more; end the stream when its requests end
    ended: bool = False


_Out = dict[_Conn, list[scheduler_pb2.TokenUpdate]]  # token updates per connection, one pass


@dataclass(slots=True)
class _Owner:
    conn: _Conn
    client_rid: int
    arrived: float
    last_token: float | None = None


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, scheduler: Scheduler, metrics: SchedulerMetrics | None = None) -> None:
        self.sched = scheduler
        self.metrics = metrics
        self.clock = RequestClock(metrics, scheduler) if metrics else None
        if metrics:
            metrics.bind(scheduler.info, scheduler.config)
        self._inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._owners: dict[int, _Owner] = {}  # scheduler rid -> who asked (loop thread only)
        self._conns: set[_Conn] = set()
        self._rids = itertools.count(1)
        self._conn_ids = itertools.count(1)
        self._stats = scheduler.stats()  # snapshot for GetLoad, replaced by the loop
        self._draining = False
        self.events = PrefixEventLog(scheduler.info.page_size)
        if scheduler.kv.cache is not None:
            scheduler.kv.cache.listener = self.events
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scheduler-loop", daemon=True)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> SchedulerService:
        self._thread.start()
        return self

    def drain(self, timeout: float) -> None:
        """SIGTERM: refuse new requests, let running ones finish (bounded), then stop the loop."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._thread.is_alive():
            if self._call(lambda: not self._owners and not self.sched.has_work()):
                break
            time.sleep(0.05)
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._inbox.put(("wake",))
            self._thread.join(timeout=10)
        for conn in list(self._conns):
            conn.outbox.put(None)
        self.events.wake()
        self.sched.close()

    # -- RPCs ------------------------------------------------------------------------------------

    def Connect(self, request_iterator: Iterator[scheduler_pb2.ConnectRequest],
                context: grpc.ServicerContext) -> Iterator[scheduler_pb2.ConnectResponse]:
        conn = _Conn(next(self._conn_ids))
        self._inbox.put(("open", conn))
        if not context.add_callback(lambda: self._inbox.put(("drop", conn))):
            self._inbox.put(("drop", conn))  # the RPC already ended
            return

        def read() -> None:
            try:
                for msg in request_iterator:
                    self._inbox.put(("batch", conn, msg))
                self._inbox.put(("half_close", conn))
            except Exception:  # the stream died: the RPC callback aborts its requests
                log.debug("connection %d: request stream ended abruptly", conn.id)

        threading.Thread(target=read, name=f"connect-{conn.id}", daemon=True).start()
        while (item := conn.outbox.get()) is not None:
            yield item

    def Abort(self, request: scheduler_pb2.AbortRequest,
              context: grpc.ServicerContext) -> scheduler_pb2.AbortResponse:
        rids = set(request.rids)
        return scheduler_pb2.AbortResponse(aborted=self._call(lambda: self._abort_any(rids)))

    def GetLoad(self, request: scheduler_pb2.GetLoadRequest,
                context: grpc.ServicerContext) -> scheduler_pb2.GetLoadResponse:
        s = self._stats
        return scheduler_pb2.GetLoadResponse(
            running_requests=s.running, waiting_requests=s.waiting, used_pages=s.used_pages,
            total_pages=s.total_pages, cached_pages=s.cached_pages,
            prefix_hit_rate=s.prefix_hit_rate,
        )

    def GetInfo(self, request: scheduler_pb2.GetInfoRequest,
                context: grpc.ServicerContext) -> scheduler_pb2.GetInfoResponse:
        info, cfg = self.sched.info, self.sched.config
        return scheduler_pb2.GetInfoResponse(
            model_name=info.model_name, max_model_len=info.max_model_len,
            page_size=info.page_size, num_pages=info.num_pages,
            max_running_requests=self.sched.max_running,
            max_queued_requests=cfg.max_queued_requests, vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
        )

    def Watch(self, request: scheduler_pb2.WatchRequest,
              context: grpc.ServicerContext) -> Iterator[scheduler_pb2.WatchResponse]:
        """Load reports every `load_interval_s` and soon after the running or waiting count
        changes (`LOAD_CHANGE_GAP_S` apart at most), and every prefix-cache change, numbered."""
        interval = max(MIN_LOAD_INTERVAL_S, request.load_interval_s or DEFAULT_LOAD_INTERVAL_S)
        page_size = self.events.page_size
        cache = self.sched.kv.cache
        sub = self._call(lambda: self.events.subscribe(request.resume_after, cache))
        try:
            cursor = sub.cursor
            if sub.snapshot is not None:
                yield scheduler_pb2.WatchResponse(seq=cursor, snapshot=True, stored=sub.snapshot,
                                                  load=self._load(), page_size=page_size)
            next_load = time.monotonic()
            sent, last = (-1, -1), 0.0  # (running, waiting) of the last report, and when
            while context.is_active() and not self._stop.is_set():
                now = time.monotonic()
                due = next_load
                if (self._stats.running, self._stats.waiting) != sent:
                    due = min(due, last + LOAD_CHANGE_GAP_S)
                wait = max(0.0, due - now)
                batches = self.events.since(cursor, wait)
                if batches is None:  # fell out of the ring: start over from the whole tree
                    cursor, hashes = self._call(lambda: self.events.snapshot(cache))
                    yield scheduler_pb2.WatchResponse(seq=cursor, snapshot=True, stored=hashes,
                                                      page_size=page_size)
                    continue
                for batch in batches:
                    cursor = batch.seq
                    yield scheduler_pb2.WatchResponse(seq=cursor, stored=batch.stored,
                                                      removed=batch.removed, page_size=page_size)
                now = time.monotonic()
                changed = (self._stats.running, self._stats.waiting) != sent
                if now >= next_load or (changed and now >= last + LOAD_CHANGE_GAP_S):
                    load = self._load()
                    sent = (load.running_requests, load.waiting_requests)
                    last = now
                    yield scheduler_pb2.WatchResponse(seq=cursor, load=load, page_size=page_size)
                    next_load = max(next_load + interval, now) if now >= next_load else next_load
        finally:
            self.events.unsubscribe()

    def _load(self) -> scheduler_pb2.EngineLoad:
        s = self._stats
        return scheduler_pb2.EngineLoad(
            running_requests=s.running, waiting_requests=s.waiting, used_pages=s.used_pages,
            total_pages=s.total_pages, cached_pages=s.cached_pages, draining=self._draining,
            max_running_requests=self.sched.max_running, watchers=self.events.subscribers)

    # -- the loop --------------------------------------------------------------------------------

    def _call(self, fn: Any, timeout: float = 30.0) -> Any:
        """Run `fn` on the loop thread (the only one that touches the scheduler)."""
        fut: Future[Any] = Future()
        self._inbox.put(("call", fn, fut))
        return fut.result(timeout=timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            out: dict[_Conn, list[scheduler_pb2.TokenUpdate]] = defaultdict(list)
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
            before, self._stats = self._stats, self.sched.stats()
            if (before.running, before.waiting) != (self._stats.running, self._stats.waiting):
                self.events.wake()  # Watch streams report the new load (LOAD_CHANGE_GAP_S)
            if self.metrics:
                self.metrics.update(self._stats)

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

    def _apply(self, cmd: tuple[Any, ...], out: _Out) -> None:
        kind = cmd[0]
        if kind == "batch":
            conn, msg = cmd[1], cmd[2]
            if not conn.ended:
                for item in msg.submits:
                    self._submit(conn, item, out)
                for client_rid in msg.aborts:
                    rid = conn.rids.get(client_rid)
                    if rid is not None:
                        self.sched.abort(rid)
                for client_rid in msg.stops:  # a stop string matched downstream
                    rid = conn.rids.get(client_rid)
                    if rid is not None:
                        self.sched.abort(rid, FinishReason.STOP)
        elif kind == "open":
            self._conns.add(cmd[1])
        elif kind == "half_close":
            cmd[1].half_closed = True
        elif kind == "drop":
            self._drop(cmd[1])
        elif kind == "call":
            fn, fut = cmd[1], cmd[2]
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

    def _submit(self, conn: _Conn, item: scheduler_pb2.SubmitItem, out: _Out) -> None:
        rid = next(self._rids)
        try:
            if self._draining:
                raise SchedulerError("the scheduler is shutting down", ErrorCode.UNAVAILABLE)
            if item.rid in conn.rids:
                raise SchedulerError(f"request id {item.rid} is already live on this connection",
                                     ErrorCode.INVALID_ARGUMENT)
            params = sampling_from_proto(item.sampling, self.sched.config.default_max_tokens)
            self.sched.submit(rid, list(item.input_ids), params)
            if item.traceparent or item.request_id:
                self.sched.traces.add(self.sched.reqs[rid], item.traceparent, item.request_id)
        except SchedulerError as exc:
            out[conn].append(scheduler_pb2.TokenUpdate(
                rid=item.rid, finish_reason=common_pb2.FINISH_REASON_ERROR,
                error=error_to_proto(exc), prompt_tokens=len(item.input_ids)))
            if self.metrics:
                self.metrics.finished("error").inc()
            return
        conn.rids[item.rid] = rid
        self._owners[rid] = _Owner(conn, item.rid, time.monotonic())
        if self.metrics and self.clock:
            self.metrics.prompt_tokens.inc(len(item.input_ids))
            self.clock.submitted(rid, self._owners[rid].arrived, len(item.input_ids),
                                 params.max_tokens)

    def _route(self, ev: TokenEvent, out: _Out) -> None:
        owner = self._owners.get(ev.rid)
        if owner is None:
            return  # its connection is gone
        now = time.monotonic()
        if ev.token_ids and self.metrics:
            if owner.last_token is None:
                self.metrics.ttft.observe(now - owner.arrived)
            else:
                gap = (now - owner.last_token) / len(ev.token_ids)
                for _ in ev.token_ids:
                    self.metrics.itl.observe(gap)
            self.metrics.generation_tokens.inc(len(ev.token_ids))
            if self.clock:
                self.clock.tokens(ev.rid, len(ev.token_ids), now)
        if ev.token_ids:
            owner.last_token = now
        # Only the fields this update has: the common one (a token, nothing else) is built
        # with two fields set, about half the cost of passing every field, 256 times a step.
        update = scheduler_pb2.TokenUpdate(rid=owner.client_rid, token_ids=ev.token_ids,
                                           prompt_tokens=ev.prompt_tokens,
                                           cached_tokens=ev.cached_tokens)
        if ev.logprobs:
            update.logprobs.extend(ev.logprobs)
            for t in ev.top_logprobs:
                update.top_logprobs.add(token_ids=t.token_ids, logprobs=t.logprobs)
        if ev.finish_reason is not None:
            update.finish_reason = FINISH_TO_PROTO[ev.finish_reason]
            if ev.error is not None:
                update.error.CopyFrom(error_to_proto(ev.error))
        out[owner.conn].append(update)
        if ev.finish_reason is not None:
            del self._owners[ev.rid]
            owner.conn.rids.pop(owner.client_rid, None)
            if self.metrics:
                self.metrics.finished(ev.finish_reason.value).inc()
                self.metrics.e2e.observe(now - owner.arrived)
                if self.clock:
                    self.clock.finished(ev.rid, now)

    def _abort_any(self, client_rids: set[int]) -> int:
        """Unary Abort: the rids of whichever connection holds them."""
        n = 0
        for conn in list(self._conns):
            for client_rid in client_rids & conn.rids.keys():
                n += self.sched.abort(conn.rids[client_rid])
        return n

    def _drop(self, conn: _Conn) -> None:
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

    def _end(self, conn: _Conn) -> None:
        conn.ended = True
        conn.outbox.put(None)
        self._conns.discard(conn)

    def _fail_all(self, out: _Out) -> None:
        error = SchedulerError("internal scheduler error")
        for rid, owner in list(self._owners.items()):
            out[owner.conn].append(scheduler_pb2.TokenUpdate(
                rid=owner.client_rid, finish_reason=FINISH_TO_PROTO[FinishReason.ERROR],
                error=error_to_proto(error)))
            owner.conn.rids.pop(owner.client_rid, None)
            try:
                self.sched.abort(rid)
            except Exception:
                log.exception("abort of %d failed", rid)
        self._owners.clear()
