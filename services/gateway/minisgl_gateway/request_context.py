"""Per-request identity at the public edge: the `x-request-id` and the request's trace span.

HTTP: `RequestContextMiddleware` reads `x-request-id` (a fresh one when absent or unusable),
returns it as a response header, and keeps it in `REQUEST_ID` for every log line of the request
(asyncio tasks the request starts inherit it). With tracing on it opens the server span of a
generation request under the client's `traceparent`; the span ends with the last byte. gRPC:
`grpc_request` does the same for the Generation API, with the id in the initial metadata.

Upstream hops read both from the current context: `traceparent()` and `REQUEST_ID.get()`.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from minisgl_core import tracing
from minisgl_core.logging import REQUEST_ID
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:  # imported at run time only with tracing on
    from opentelemetry import context as otel_context
    from opentelemetry import trace

HEADER = "x-request-id"
_USABLE = re.compile(r"^[\x21-\x7e]{1,128}$")  # visible ASCII, what a header and a log line hold
TRACED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


def request_id_from(value: str | bytes | None) -> str:
    """The client's id when usable, else a new random one."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if value and _USABLE.match(value):
        return value
    return uuid.uuid4().hex


def traceparent() -> str:
    """The current request span as a W3C traceparent; empty when tracing is off or unsampled."""
    if not tracing.ENABLED:
        return ""
    from opentelemetry import trace

    return tracing.traceparent_of(trace.get_current_span())


def upstream_metadata() -> list[tuple[str, str]]:
    """gRPC metadata for a unary upstream call: the request id and the trace context."""
    md: list[tuple[str, str]] = []
    rid = REQUEST_ID.get()
    if rid:
        md.append((HEADER, rid))
    if tracing.ENABLED:
        md += tracing.inject_metadata()
    return md


@contextlib.contextmanager
def request_scope(request_id: str, name: str, parent: otel_context.Context | None,
                  attributes: dict[str, str | int | float | bool]) -> Iterator[trace.Span | None]:
    """`REQUEST_ID` set, and with tracing on a current server span, for the block."""
    rid_token = REQUEST_ID.set(request_id)
    span: trace.Span | None = None
    ctx_token = None
    if tracing.ENABLED:
        from opentelemetry import context as otel_context
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        span = tracing.start_span(name, parent, {**attributes, "minisgl.request_id": request_id},
                                  kind=SpanKind.SERVER)
        ctx_token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield span
    finally:
        if ctx_token is not None:
            from opentelemetry import context as otel_context

            otel_context.detach(ctx_token)
        if span is not None:
            span.end()
        REQUEST_ID.reset(rid_token)


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = dict(scope.get("headers") or [])
        rid = request_id_from(headers.get(b"x-request-id"))
        path = scope.get("path", "")
        parent = None
        if tracing.ENABLED and path in TRACED_PATHS:
            carrier = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers.items()
                       if k in (b"traceparent", b"tracestate")]
            parent = tracing.context_from_metadata(carrier)
        name = f"{scope.get('method', 'GET')} {path}"
        traced = tracing.ENABLED and path in TRACED_PATHS
        scoped = request_scope(rid, name, parent, {"http.request.method": scope.get("method", ""),
                                                   "url.path": path}) if traced else only_request_id(rid)
        with scoped as span:
            header = (HEADER.encode(), rid.encode())

            async def _send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), header]}
                    if span is not None:
                        status = int(message["status"])
                        span.set_attribute("http.response.status_code", status)
                        if status >= 500:
                            from opentelemetry.trace import Status, StatusCode

                            span.set_status(Status(StatusCode.ERROR))
                        span.add_event("first_byte")
                elif span is not None and not message.get("more_body", False):
                    span.add_event("last_byte")
                await send(message)

            await self.app(scope, receive, _send)


@contextlib.contextmanager
def only_request_id(request_id: str) -> Iterator[None]:
    token = REQUEST_ID.set(request_id)
    try:
        yield None
    finally:
        REQUEST_ID.reset(token)


def grpc_request_id(metadata: Any, body_id: str = "") -> str:
    """The id of a public gRPC call: `x-request-id` metadata, else the message's request_id."""
    for key, value in metadata or ():
        if key == HEADER:
            return request_id_from(value)
    return request_id_from(body_id)
