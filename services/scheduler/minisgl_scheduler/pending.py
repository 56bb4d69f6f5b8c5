"""The Scheduler gRPC service before the worker answered: listening, but UNAVAILABLE.

The scheduler starts listening at once (health NOT_SERVING) and waits for its worker as long as it
takes, since it learns its page pool from the worker. The gRPC server needs its servicer before
it starts, so it gets this one, which refuses every call until `attach` hands it the real service.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
from minisgl_core.proto.minisgl.v1 import scheduler_pb2, scheduler_pb2_grpc

from minisgl_scheduler.server import SchedulerService


class PendingScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.service: SchedulerService | None = None

    def attach(self, service: SchedulerService) -> None:
        self.service = service

    def drain(self, timeout: float) -> None:
        if self.service is not None:
            self.service.drain(timeout)

    def _ready(self, context: grpc.ServicerContext) -> SchedulerService:
        if self.service is None:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"the scheduler is waiting for its worker at {self.worker}")
        assert self.service is not None
        return self.service

    def Connect(self, request_iterator: Iterator[scheduler_pb2.ConnectRequest],
                context: grpc.ServicerContext) -> Iterator[scheduler_pb2.ConnectResponse]:
        yield from self._ready(context).Connect(request_iterator, context)

    def Abort(self, request: scheduler_pb2.AbortRequest,
              context: grpc.ServicerContext) -> scheduler_pb2.AbortResponse:
        return self._ready(context).Abort(request, context)

    def GetLoad(self, request: scheduler_pb2.GetLoadRequest,
                context: grpc.ServicerContext) -> scheduler_pb2.GetLoadResponse:
        return self._ready(context).GetLoad(request, context)

    def GetInfo(self, request: scheduler_pb2.GetInfoRequest,
                context: grpc.ServicerContext) -> scheduler_pb2.GetInfoResponse:
        return self._ready(context).GetInfo(request, context)

    def Watch(self, request: scheduler_pb2.WatchRequest,
              context: grpc.ServicerContext) -> Iterator[scheduler_pb2.WatchResponse]:
        yield from self._ready(context).Watch(request, context)
