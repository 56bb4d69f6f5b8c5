"""Errors the scheduler reports, with codes that mirror `minisgl.v1.ErrorCode`.

`submit` raises them for refused requests; failed requests carry one in their final `TokenEvent`.
Messages are meant for the client: they say what was wrong and what the limit is.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    # Values equal the proto enum so the gRPC adapter converts with `int(code)`.
    INVALID_ARGUMENT = 1
    CONTEXT_LENGTH_EXCEEDED = 2
    OVERLOADED = 3
    INTERNAL = 4
    UNAVAILABLE = 5


class SchedulerError(Exception):
    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}: {self.message})"


class InvalidRequest(SchedulerError):
    code = ErrorCode.INVALID_ARGUMENT


class ContextLengthExceeded(SchedulerError):
    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED


class Overloaded(SchedulerError):
    """The waiting queue is full; the client should retry later (gRPC RESOURCE_EXHAUSTED)."""

    code = ErrorCode.OVERLOADED


class WorkerFailed(SchedulerError):
    code = ErrorCode.UNAVAILABLE
