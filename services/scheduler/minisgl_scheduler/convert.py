"""The scheduler's own protobuf mappings (finish reasons, errors); the shared ones live in
minisgl_core.convert."""

from __future__ import annotations

from typing import overload

from minisgl_core import convert as core
from minisgl_core.codes import FINISH_TO_PROTO, ErrorCode, proto_error
from minisgl_core.convert import step_error
from minisgl_core.proto.minisgl.v1 import common_pb2, worker_pb2
from minisgl_core.step import StepOutput

from minisgl_scheduler.errors import SchedulerError

__all__ = ["FINISH_TO_PROTO", "error_from_proto", "error_to_proto", "output_from_proto"]


@overload
def error_to_proto(err: SchedulerError) -> common_pb2.Error: ...
@overload
def error_to_proto(err: None) -> None: ...
def error_to_proto(err: SchedulerError | None) -> common_pb2.Error | None:
    if err is None:
        return None
    return proto_error(err.code, err.message)


def error_from_proto(m: common_pb2.Error) -> SchedulerError:
    try:
        code = ErrorCode(m.code)
    except ValueError:
        code = ErrorCode.INTERNAL
    return SchedulerError(m.message, code)


def output_from_proto(msg: worker_pb2.StepResponse) -> StepOutput:
    """Raises the step's error when the worker reported one."""
    err = step_error(msg)
    if err is not None:
        raise SchedulerError(f"the worker failed step {msg.step_id}: {err.message}",
                             ErrorCode.UNAVAILABLE)
    return core.output_from_proto(msg)
