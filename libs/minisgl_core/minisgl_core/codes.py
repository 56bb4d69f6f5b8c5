"""Error codes and finish reasons: the one Python declaration every service uses.

Both mirror enums of `protos/minisgl/v1/common.proto` (tests/test_codes.py keeps them equal):
`ErrorCode` has the proto's values, so `int(code)` is the wire value; a `FinishReason`'s value is the
name clients see (OpenAI's `finish_reason`), and `FINISH_TO_PROTO` / `FINISH_FROM_PROTO` convert it.
"""

from __future__ import annotations

import enum
from typing import cast

from minisgl_core.proto.minisgl.v1 import common_pb2


class ErrorCode(enum.IntEnum):
    """`minisgl.v1.ErrorCode` without UNSPECIFIED (an error always has a code)."""

    INVALID_ARGUMENT = 1
    CONTEXT_LENGTH_EXCEEDED = 2
    OVERLOADED = 3  # queue full: retry later
    INTERNAL = 4
    UNAVAILABLE = 5  # an upstream service is down


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token, or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # the client went away or cancelled
    ERROR = "error"  # the request failed; its error says why


# None: the request has not finished (FINISH_REASON_UNSPECIFIED on the wire).
FINISH_TO_PROTO: dict[FinishReason | None, common_pb2.FinishReason] = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
FINISH_FROM_PROTO: dict[int, FinishReason | None] = {v: k for k, v in FINISH_TO_PROTO.items()}


def wire_code(code: ErrorCode) -> common_pb2.ErrorCode:
    """The same number, typed as the generated enum that message fields expect."""
    return cast(common_pb2.ErrorCode, int(code))


def proto_error(code: ErrorCode, message: str) -> common_pb2.Error:
    return common_pb2.Error(code=wire_code(code), message=message)


def finish_name(value: int) -> str | None:
    """The client-facing name of a wire finish reason; None while unfinished (or unknown)."""
    reason = FINISH_FROM_PROTO.get(value)
    return None if reason is None else reason.value
