"""The scheduler's own protobuf mappings (finish reasons, errors); the shared ones live in
minisgl_core.convert."""

from __future__ import annotations

from typing import overload

from minisgl_core import convert as core
from minisgl_core.codes import FINISH_TO_PROTO, ErrorCode, proto_error
from minisgl_core.convert import step_error
from minisgl_core.proto.minisgl.v1 import common_pb2, scheduler_pb2, worker_pb2
from minisgl_core.step import StepOutput

from minisgl_scheduler.errors import SchedulerError
from minisgl_scheduler.request import TokenEvent

__all__ = ["FINISH_TO_PROTO", "error_from_proto", "error_to_proto", "output_from_proto",
           "token_update"]


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


def token_update(client_rid: int, ev: TokenEvent) -> scheduler_pb2.TokenUpdate:
    """A step's event for one request, named by the client's rid. Only the fields the event has
    are set: the common update (a token, nothing else) is built on the loop thread for every
    decoding request every step, and passing every field costs about twice as much."""
    update = scheduler_pb2.TokenUpdate(rid=client_rid, token_ids=ev.token_ids,
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
    return update
