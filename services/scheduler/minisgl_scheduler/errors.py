"""Errors the scheduler reports, with the shared `ErrorCode`s (minisgl_core.codes).

`submit` raises them for refused requests; failed requests carry one in their final `TokenEvent`.
Messages are meant for the client: they say what was wrong and what the limit is.
"""

from __future__ import annotations

from minisgl_core.codes import ErrorCode

# ErrorCode is re-exported: `minisgl_scheduler.errors.ErrorCode` is the shared enum itself.
__all__ = ["ErrorCode", "SchedulerError", "InvalidRequest", "ContextLengthExceeded", "Overloaded",
           "WorkerFailed"]


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
