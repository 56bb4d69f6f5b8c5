"""The `minisgl.v1.Scheduler` gRPC service: a thin adapter over `Scheduler`.

The scheduler runs on `SchedulerLoop`'s thread (loop.py). The RPCs here translate protobuf to the
loop's commands (commands.py) and back: a Connect stream becomes Open, one Batch per message,
HalfClose and Drop; Abort and the snapshots run on the loop through `call`; GetLoad reads the loop's
latest load snapshot; Watch is a `WatchStream` (watch.py).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator

import grpc
from minisgl_core.convert import sampling_from_proto
from minisgl_core.proto.minisgl.v1 import scheduler_pb2, scheduler_pb2_grpc

from minisgl_scheduler.commands import Batch, Drop, HalfClose, Open, Submit
from minisgl_scheduler.connection import Conn
from minisgl_scheduler.loop import SchedulerLoop
from minisgl_scheduler.metrics import SchedulerMetrics
from minisgl_scheduler.scheduler import Scheduler
from minisgl_scheduler.stats import SchedulerStats
from minisgl_scheduler.watch import WatchStream

log = logging.getLogger(__name__)


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, scheduler: Scheduler, metrics: SchedulerMetrics | None = None) -> None:
        self.sched = scheduler
        self.loop = SchedulerLoop(scheduler, metrics)
        if metrics:
            metrics.bind(scheduler.info, scheduler.config)
        self._conn_ids = itertools.count(1)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> SchedulerService:
        self.loop.start()
        return self

    def drain(self, timeout: float) -> None:
        """SIGTERM: refuse new requests, let running ones finish (bounded), then stop the loop."""
        self.loop.draining = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.loop.alive:
            if self.loop.call(self.loop.idle):
                break
            time.sleep(0.05)
        self.stop()

    def stop(self) -> None:
        self.loop.stop()

    # -- RPCs ------------------------------------------------------------------------------------

    def Connect(self, request_iterator: Iterator[scheduler_pb2.ConnectRequest],
                context: grpc.ServicerContext) -> Iterator[scheduler_pb2.ConnectResponse]:
        conn = Conn(next(self._conn_ids))
        loop = self.loop
        loop.put(Open(conn))
        if not context.add_callback(lambda: loop.put(Drop(conn))):
            loop.put(Drop(conn))  # the RPC already ended
            return
        default_max_tokens = self.sched.config.default_max_tokens

        def read() -> None:
            try:
                for msg in request_iterator:
                    loop.put(_batch(conn, msg, default_max_tokens))
                loop.put(HalfClose(conn))
            except Exception:  # the stream died: the RPC callback aborts its requests
                log.debug("connection %d: request stream ended abruptly", conn.id)

        threading.Thread(target=read, name=f"connect-{conn.id}", daemon=True).start()
        while (item := conn.outbox.get()) is not None:
            yield item

    def Abort(self, request: scheduler_pb2.AbortRequest,
              context: grpc.ServicerContext) -> scheduler_pb2.AbortResponse:
        rids = set(request.rids)
        return scheduler_pb2.AbortResponse(aborted=self.loop.call(lambda: self.loop.abort_any(rids)))

    def GetLoad(self, request: scheduler_pb2.GetLoadRequest,
                context: grpc.ServicerContext) -> scheduler_pb2.GetLoadResponse:
        s = self.loop.stats
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
        loop = self.loop
        # A stream the client ended wakes at once to let go of its thread and subscription.
        context.add_callback(loop.changes.notify)
        sched = self.sched
        stream = WatchStream(loop.events, loop.changes, loop.call, lambda: sched.kv.cache,
                             lambda: loop.stats, self._load)
        yield from stream.run(request, lambda: context.is_active() and not loop.stopped)

    def _load(self, s: SchedulerStats) -> scheduler_pb2.EngineLoad:
        return scheduler_pb2.EngineLoad(
            running_requests=s.running, waiting_requests=s.waiting, used_pages=s.used_pages,
            total_pages=s.total_pages, cached_pages=s.cached_pages, draining=self.loop.draining,
            max_running_requests=self.sched.max_running, watchers=self.loop.events.subscribers,
            worker_down=s.worker_down)


def _batch(conn: Conn, msg: scheduler_pb2.ConnectRequest, default_max_tokens: int) -> Batch:
    """One Connect message as the loop's command (on the stream's reader thread)."""
    return Batch(
        conn,
        submits=tuple(Submit(item.rid, list(item.input_ids),
                             sampling_from_proto(item.sampling, default_max_tokens),
                             item.traceparent, item.request_id, item.cache_salt,
                             item.num_prompt_tokens, item.priority, item.tenant)
                      for item in msg.submits),
        aborts=tuple(msg.aborts), stops=tuple(msg.stops))
