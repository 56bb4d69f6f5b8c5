"""The worker's own protobuf helper; the message mappings are shared in minisgl_core.convert."""

from __future__ import annotations

from minisgl_core.proto.minisgl.v1 import common_pb2, worker_pb2


def error_response(step_id: int, code: int, message: str) -> worker_pb2.StepResponse:
    return worker_pb2.StepResponse(step_id=step_id,
                                   error=common_pb2.Error(code=code, message=message))
