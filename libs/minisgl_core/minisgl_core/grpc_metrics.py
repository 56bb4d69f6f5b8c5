"""gRPC server metrics for every internal service (a server interceptor that `ServiceHost` installs).

    minisgl_grpc_server_handled_total{grpc_service, grpc_method, grpc_code}
    minisgl_grpc_server_handling_seconds{grpc_service, grpc_method}   (histogram)

Names and labels follow go-grpc-prometheus, so its dashboards' queries read them. A stream counts
once, when it ends: its code is the stream's final status and its duration is open to close (a
scheduler Connect or worker Step stream lives as long as its peer, so these say little about step
latency, which the services' own histograms give). Counting per stream, not per message, keeps the
hot streams free of metric calls: the wrapper adds one generator frame per message and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from minisgl_core.metrics import STEP_BUCKETS, counter, histogram

_HANDLED = counter("grpc_server_handled_total", "gRPC calls and streams ended, by status code",
                   ("grpc_service", "grpc_method", "grpc_code"))
_SECONDS = histogram("grpc_server_handling_seconds", "gRPC call (or stream) duration",
                     (*STEP_BUCKETS, 5.0, 30.0, 120.0), ("grpc_service", "grpc_method"))


def _split(full_method: str) -> tuple[str, str]:
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service or "unknown", method or "unknown"


def _code(context: grpc.ServicerContext, error: BaseException | None) -> str:
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        return code.name
    if error is not None:
        return "CANCELLED" if isinstance(error, GeneratorExit) else "UNKNOWN"
    return "OK"


class MetricsInterceptor(grpc.ServerInterceptor):
    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or not hasattr(handler, "_replace"):
            return handler
        service, method = _split(details.method)
        done = _SECONDS.labels(service, method)

        def record(context: grpc.ServicerContext, t0: float, error: BaseException | None) -> None:
            _HANDLED.labels(service, method, _code(context, error)).inc()
            done.observe(time.monotonic() - t0)

        def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                t0, error = time.monotonic(), None
                try:
                    return behavior(request, context)
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    record(context, t0, error)
            return call

        def streaming(behavior: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
            def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                t0, error = time.monotonic(), None
                try:
                    yield from behavior(request, context)
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    record(context, t0, error)
            return call

        if handler.unary_unary:
            return handler._replace(unary_unary=unary(handler.unary_unary))
        if handler.stream_unary:
            return handler._replace(stream_unary=unary(handler.stream_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=streaming(handler.unary_stream))
        if handler.stream_stream:
            return handler._replace(stream_stream=streaming(handler.stream_stream))
        return handler
