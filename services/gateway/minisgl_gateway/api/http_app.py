"""The OpenAI-compatible HTTP API (FastAPI): routes, auth, body limit, errors, SSE streaming.

A generation is answered by `GenerationResponse`, a small ASGI response that watches for the
client hanging up for the whole life of the request (queued, prefilling or streaming) and aborts
upstream at once when it does. Errors found before the first byte go out as an OpenAI error body
with the right status; later ones as a final SSE `data: {"error": ...}` event."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl_gateway import metrics
from minisgl_gateway.api.choice_output import echo_prefixes
from minisgl_gateway.api.generation import Generation
from minisgl_gateway.api.http_limits import client_gone
from minisgl_gateway.api.job import Job
from minisgl_gateway.api.json_body import context_body_limit
from minisgl_gateway.api.openai_format import DONE, Formatter, error_event, model_card
from minisgl_gateway.api.openai_schema import parse_request
from minisgl_gateway.api.token_routes import add_token_routes
from minisgl_gateway.errors import ApiError, invalid
from minisgl_gateway.gateway import Gateway
from minisgl_gateway.request_context import RequestContextMiddleware

log = logging.getLogger(__name__)

ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready",
             "/metrics"}
_DRAIN_CAP = 64 * 1024 * 1024  # past the limit, read (and drop) this much so the client sees 413
SERVER_SEND = "minisgl.server_send"  # scope key: the ASGI server's own `send` (see KeepServerSend)


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


async def read_body(request: Request, limit: int, soft_limit: int = 0,
                    soft_error: ApiError | None = None) -> bytes:
    """The body; 413 past `limit` bytes, `soft_error` past `soft_limit` (a smaller bound with its
    own reason). Nothing past the smaller bound is kept."""
    length = request.headers.get("content-length")
    if length is not None and not length.strip().isdigit():
        raise invalid("invalid Content-Length header")
    keep = min(limit, soft_limit) if soft_limit else limit
    parts, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > keep:
                if size > _DRAIN_CAP:
                    break
                continue  # keep reading so the client is not cut off mid-upload
            parts.append(part)
    except ClientDisconnect:
        raise client_gone(request) from None
    if size > limit:
        raise ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
    if size > keep and soft_error is not None:
        raise soft_error
    return b"".join(parts)


class MetricsMiddleware:
    """Counts every HTTP request by endpoint and final status."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        status = 499  # no response at all: the client hung up first

        async def _send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            metrics.HTTP_REQUESTS.labels(endpoint, str(status)).inc()


class KeepServerSend:
    """The outermost ASGI layer: puts the server's own `send` in the scope.

    Every middleware between the server and a route wraps `send` in a coroutine of its own that
    only looks at `http.response.start`. A stream sends its start (and its end) through them, so
    each one sees the response begin and finish, and its body chunks straight to the server:
    three coroutine layers less for every token of every stream. Only valid while no middleware
    rewrites response bodies (none here does: no compression)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND] = send
        await self.app(scope, receive, send)


class GenerationResponse(Response):
    def __init__(self, gateway: Gateway, job: Job, stream: bool, include_usage: bool) -> None:
        super().__init__()
        self.gateway = gateway
        self.job = job
        self.stream = stream
        self.include_usage = include_usage
        self._started = False  # response headers went out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.create_task(self._run(send, scope.get(SERVER_SEND, send)))
        hangup = asyncio.create_task(_wait_disconnect(receive))
        done, _ = await asyncio.wait({work, hangup}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:  # the client went away: stop generating for it now
            log.debug("client disconnected; aborting")
            work.cancel()
        hangup.cancel()
        for task in (work, hangup):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _send_json(self, send: Send, status: int, body: Any,
                         headers: dict[str, str] | None = None) -> None:
        raw = json.dumps(body, ensure_ascii=False).encode()
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        self._started = True
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": raw})

    async def _run(self, send: Send, body_send: Send) -> None:
        """`body_send` carries the chunks of a stream after its start (see KeepServerSend)."""
        gen: Generation | None = None
        try:
            with self.gateway.reserve(self.job.tenant):
                gen = Generation(self.gateway, self.job)
                await gen.start()
                if self.stream:
                    await self._stream(gen, send, body_send)
                else:
                    await self._whole(gen, send)
        except ApiError as err:
            await self._fail(send, err)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("generation failed")
            await self._fail(send, ApiError(500, "internal error in the gateway",
                                            code="internal_error"))
        finally:
            if gen is not None:
                gen.close()

    async def _fail(self, send: Send, err: ApiError) -> None:
        if not self._started:
            await self._send_json(send, err.status, err.body(), err.headers())
            return
        await send({"type": "http.response.body", "body": error_event(err) + DONE,
                    "more_body": False})

    async def _formatter(self) -> Formatter:
        job = self.job
        echo = await echo_prefixes(job, self.gateway.detokenize)
        return Formatter(job.kind, self.gateway.info.name, job.tool_parser,
                         job.reasoning_parser, echo)

    async def _whole(self, gen: Generation, send: Send) -> None:
        fmt = await self._formatter()
        choices = await gen.collect(fmt.observe)
        body = fmt.response(choices, gen.usage(), self.job.sampling.logprobs)
        await self._send_json(send, 200, body)

    async def _stream(self, gen: Generation, send: Send, body_send: Send) -> None:
        fmt = await self._formatter()
        if self.job.continuous_usage:
            fmt.usage_now = gen.usage
        logprobs, include_usage = self.job.sampling.logprobs, self.include_usage
        chunks = gen.chunks()
        first = await anext(chunks)  # an early failure still gets a proper status
        self._started = True
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
        head = [fmt.role_chunk(gen.num_choices, include_usage)] if self.job.kind == "chat" \
            else []
        body = b"".join(head + fmt.stream_chunks(first, logprobs, include_usage))
        await body_send({"type": "http.response.body", "body": body, "more_body": True})
        stream_chunks = fmt.stream_chunks
        async for item in chunks:
            parts = stream_chunks(item, logprobs, include_usage)
            if parts:
                await body_send({"type": "http.response.body",
                                 "body": parts[0] if len(parts) == 1 else b"".join(parts),
                                 "more_body": True})
        tail = fmt.usage_chunk(gen.usage()) if include_usage else b""
        await send({"type": "http.response.body", "body": tail + DONE, "more_body": False})


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# FastAPI releases with built-in OpenTelemetry would add their own spans (parented to the client,
# beside ours) and metrics to every request: the gateway's spans are request_context's alone.
_NO_NATIVE_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


def create_app(gateway: Gateway) -> FastAPI:
    """The FastAPI app; serve it wrapped in `KeepServerSend` (what `asgi_app` returns)."""
    app = FastAPI(title="minisgl gateway", docs_url=None, redoc_url=None, openapi_url=None,
                  **_NO_NATIVE_TELEMETRY)
    app.add_middleware(MetricsMiddleware)
    app.add_middleware(RequestContextMiddleware)  # outermost: the id is on every response
    started = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error: %r", exc, exc_info=exc)
        return error_response(ApiError(500, "internal error in the gateway",
                                       code="internal_error"))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        status = await gateway.upstream_health()
        ok = all(status.values()) and not gateway.draining
        body = {"status": "ready" if ok else "not ready", "draining": gateway.draining,
                "upstreams": status}
        retry = {"Retry-After": str(gateway.limits.retry_after_s)}
        return JSONResponse(body, status_code=200 if ok else 503, headers={} if ok else retry)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gateway.check_key(request.headers.get("authorization"))
        info = gateway.info
        return {"object": "list", "data": [model_card(info.name, info.max_model_len, started)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> dict[str, Any]:
        gateway.check_key(request.headers.get("authorization"))
        gateway.check_model(model)
        return model_card(gateway.info.name, gateway.info.max_model_len, started)

    async def generate(request: Request, endpoint: str) -> GenerationResponse:
        gateway.check_key(request.headers.get("authorization"))
        tenant = gateway.tenant(request.headers.get("authorization"))
        # Admission first: under overload a 429 costs no body read and no parsing.
        gateway.check_capacity(tenant)
        context = gateway.info.max_model_len
        fits = context_body_limit(context)  # no request with a prompt that fits is larger
        raw = await read_body(request, gateway.limits.max_body_bytes, fits, invalid(
            f"the request body exceeds {fits} bytes: no request whose prompt fits the context "
            f"window ({context} tokens) is that large", code="context_length_exceeded"))
        # The routes below pass only "chat" or "completion" (the Endpoint literal).
        job, stream, include_usage = await parse_request(
            endpoint, raw, gateway.info.formats, context)  # type: ignore[arg-type]
        job.session = request.headers.get("x-session-id") or job.session
        job.cache_salt = gateway.cache_salt(request.headers.get("authorization"), job.cache_salt)
        job.tenant = tenant
        return GenerationResponse(gateway, job, stream, include_usage)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> GenerationResponse:
        return await generate(request, "chat")

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> GenerationResponse:
        return await generate(request, "completion")

    add_token_routes(app, gateway)

    return app


def asgi_app(gateway: Gateway) -> ASGIApp:
    """What the HTTP server runs: the app under the layer that lets streams skip the middleware
    on their body chunks."""
    return KeepServerSend(create_app(gateway))
