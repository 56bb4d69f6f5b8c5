"""One error type for both public protocols: an HTTP status + OpenAI error body, and the matching
gRPC status code. Upstream `minisgl.v1.Error`s and gRPC failures map onto it here, in one place."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from minisgl_core.codes import ErrorCode
from minisgl_core.proto.minisgl.v1 import common_pb2

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout",
}

_GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    502: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


@dataclass
class ApiError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    retry_after: int | None = None  # seconds; sent as Retry-After (HTTP) / retry-after (gRPC)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error")

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_CODES.get(self.status, grpc.StatusCode.UNKNOWN)

    def body(self) -> dict[str, dict[str, object]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def overloaded(message: str, retry_after: int) -> ApiError:
    return ApiError(429, message, code="overloaded", retry_after=retry_after)


def unavailable(message: str, retry_after: int) -> ApiError:
    return ApiError(503, message, code="upstream_unavailable", retry_after=retry_after)


def from_upstream(error: common_pb2.Error, retry_after: int, param: str | None = None) -> ApiError:
    """A `minisgl.v1.Error` from the tokenizer or scheduler, as the client should see it."""
    code, message = int(error.code), error.message or "the request failed upstream"
    if code == ErrorCode.INVALID_ARGUMENT:
        return invalid(message, param=param)
    if code == ErrorCode.CONTEXT_LENGTH_EXCEEDED:
        return invalid(message, param=param or "messages", code="context_length_exceeded")
    if code == ErrorCode.OVERLOADED:
        return overloaded(message, retry_after)
    if code == ErrorCode.UNAVAILABLE:
        return unavailable(message, retry_after)
    return ApiError(502, message, code="upstream_error")


def from_rpc_error(service: str, exc: grpc.RpcError, retry_after: int) -> ApiError:
    """A failed call to an internal service: the client learns which one, never a bare 500."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, f"the {service} did not answer in time", code="upstream_timeout")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return overloaded(f"the {service} is overloaded: {details}", retry_after)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return invalid(f"the {service} rejected the request: {details}")
    return unavailable(f"the {service} is unavailable ({code.name if code else 'error'}): "
                       f"{details}", retry_after)


def model_error(name: str) -> ApiError:
    return ApiError(404, f"The model `{name}` does not exist", param="model",
                    code="model_not_found")
