"""The worker's own protobuf helper; the message mappings are shared in minisgl_core.convert."""

from __future__ import annotations

from minisgl_core.codes import ErrorCode, proto_error
from minisgl_core.proto.minisgl.v1 import worker_pb2


def error_response(step_id: int, code: ErrorCode, message: str) -> worker_pb2.StepResponse:
    return worker_pb2.StepResponse(step_id=step_id,
                                   error=proto_error(code, message))
