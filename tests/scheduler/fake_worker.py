"""The fake GPU behind a real `minisgl.v1.Worker` gRPC server, for the scheduler's network tests."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
from minisgl_core.convert import info_to_proto, output_to_proto, plan_from_proto
from minisgl_core.proto.minisgl.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from minisgl_core.serving import ServiceHost

from .fake_executor import FakeExecutor


class FakeWorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, fake: FakeExecutor, step_delay: float = 0.0) -> None:
        self.fake = fake
        self.step_delay = step_delay  # seconds per step: lets tests act while requests run
        self.steps = 0

    def GetWorkerInfo(self, request: worker_pb2.GetWorkerInfoRequest,
                      context: grpc.ServicerContext) -> worker_pb2.GetWorkerInfoResponse:
        return info_to_proto(self.fake.info())

    def Step(self, request_iterator: Iterator[worker_pb2.StepRequest],
             context: grpc.ServicerContext) -> Iterator[worker_pb2.StepResponse]:
        for msg in request_iterator:
            time.sleep(self.step_delay)
            self.steps += 1
            try:
                self.fake.launch(plan_from_proto(msg))
                out = self.fake.collect()
            except Exception as exc:
                yield worker_pb2.StepResponse(step_id=msg.step_id, error=common_pb2.Error(
                    code=common_pb2.ERROR_CODE_INTERNAL, message=str(exc)))
                continue
            yield output_to_proto(out)


def start_fake_worker(fake: FakeExecutor, step_delay: float = 0.0) -> tuple[ServiceHost, str]:
    host = ServiceHost("fake-worker", "127.0.0.1", 0)
    servicer = FakeWorkerServicer(fake, step_delay)
    host.add(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "minisgl.v1.Worker")
    port = host.start()
    host.servicer = servicer  # type: ignore[attr-defined]
    return host, f"127.0.0.1:{port}"
