"""The public gRPC API, `minisgl.v1.Generation`, over the same jobs as the HTTP API.

Errors become gRPC status codes (INVALID_ARGUMENT, NOT_FOUND, UNAUTHENTICATED,
RESOURCE_EXHAUSTED with a retry-after trailer, UNAVAILABLE). A cancelled call or an expired
deadline cancels the handler; `Generation.close()` in its `finally` aborts upstream at once."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from minisgl_core import tracing
from minisgl_core.logging import REQUEST_ID
from minisgl_core.proto.minisgl.v1 import (
    generation_pb2,
    generation_pb2_grpc,
)

from minisgl_gateway import metrics
from minisgl_gateway.api.choice_output import echo_prefixes
from minisgl_gateway.api.generation import Generation
from minisgl_gateway.api.grpc_format import GrpcOutput, usage_message
from minisgl_gateway.api.grpc_schema import Undecodable, job_for
from minisgl_gateway.api.job import Job
from minisgl_gateway.api.openai_schema import INLINE_PARSE_BYTES
from minisgl_gateway.errors import ApiError
from minisgl_gateway.gateway import Gateway
from minisgl_gateway.request_context import HEADER, grpc_request_id, request_scope
from minisgl_gateway.request_context import only_request_id as request_scope_id

log = logging.getLogger(__name__)

SERVICE_NAME = "minisgl.v1.Generation"


def _parse(parse: Callable[[bytes], Any], raw: bytes) -> Any:
    # grpc's own deserialization failure surfaces as UNKNOWN; the client deserves a 400-class code.
    try:
        return parse(raw)
    except DecodeError as exc:
        return Undecodable(str(exc))


class _Deferred:
    """A request message too large to decode on the event loop (grpc deserializes there): its
    bytes, decoded in a thread by `_materialize`."""

    def __init__(self, parse: Callable[[bytes], Any], raw: bytes) -> None:
        self.parse = parse
        self.raw = raw


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        if len(raw) > INLINE_PARSE_BYTES:
            return _Deferred(parse, raw)
        return _parse(parse, raw)

    return deserialize


async def _materialize(request: object) -> object:
    if isinstance(request, _Deferred):
        return await asyncio.to_thread(_parse, request.parse, request.raw)
    return request


def add_to_server(service: GenerationService, server: grpc.aio.Server) -> None:
    """Like the generated add_GenerationServicer_to_server, with lenient deserializers."""
    gen, chat = generation_pb2.GenerateRequest, generation_pb2.ChatRequest
    out = generation_pb2.GenerateResponse.SerializeToString
    # The streams are served by `_stream` itself rather than through GenerateStream/ChatStream,
    # which re-yield every message: one async generator layer less per message. A partial of an
    # async generator method is still one to grpc (inspect unwraps partials), so it is driven
    # on the event loop, not in a thread.
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            service.Generate, _lenient(gen.FromString), out),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            functools.partial(service._stream, "GenerateStream"), _lenient(gen.FromString), out),
        "Chat": grpc.unary_unary_rpc_method_handler(
            service.Chat, _lenient(chat.FromString), out),
        "ChatStream": grpc.unary_stream_rpc_method_handler(
            functools.partial(service._stream, "ChatStream"), _lenient(chat.FromString), out),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            service.ListModels, _lenient(generation_pb2.ListModelsRequest.FromString),
            generation_pb2.ListModelsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _session(context: grpc.aio.ServicerContext) -> str:
    """The sticky-routing key of a call: its x-session-id metadata."""
    for key, value in context.invocation_metadata() or ():
        if key == "x-session-id" and isinstance(value, str):
            return value
    return ""


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    # -- plumbing ----------------------------------------------------------------------------

    def _auth(self, context: grpc.aio.ServicerContext) -> None:
        metadata = {k: v for k, v in (context.invocation_metadata() or ())}
        value = metadata.get("authorization")
        self.gateway.check_key(value if isinstance(value, str) else None)

    def _salt(self, context: grpc.aio.ServicerContext, salt: str) -> str:
        metadata = {k: v for k, v in (context.invocation_metadata() or ())}
        value = metadata.get("authorization")
        return self.gateway.cache_salt(value if isinstance(value, str) else None, salt)

    def _tenant(self, context: grpc.aio.ServicerContext) -> int:
        metadata = {k: v for k, v in (context.invocation_metadata() or ())}
        value = metadata.get("authorization")
        return self.gateway.tenant(value if isinstance(value, str) else None)

    async def _abort(self, context: grpc.aio.ServicerContext, method: str,
                     err: ApiError) -> None:
        metrics.GRPC_REQUESTS.labels(method, err.grpc_code.name).inc()
        trailers = (("retry-after", str(err.retry_after)),) if err.retry_after is not None else ()
        await context.abort(err.grpc_code, err.message, trailing_metadata=trailers)

    def _response(self, request_id: str) -> generation_pb2.GenerateResponse:
        return generation_pb2.GenerateResponse(request_id=request_id,
                                               model=self.gateway.info.name)

    async def _job(self, method: str, request: object, large: bool) -> Job:
        """The call's job, bounds checked; built in a thread for a large message, where walking
        its items and parsing its JSON strings cannot stall other streams."""
        info = self.gateway.info
        if large:
            return await asyncio.to_thread(job_for, method, request, info.formats,
                                           info.max_model_len)
        return job_for(method, request, info.formats, info.max_model_len)

    @contextlib.asynccontextmanager
    async def _call(self, method: str, context: grpc.aio.ServicerContext, request: object = None
                    ) -> AsyncIterator[list[Generation]]:
        """One RPC's error mapping and clean-up: the body appends its Generation to the list;
        it is closed (aborting what still runs upstream) however the call ends. The request id
        (x-request-id metadata, else the message's) goes back in the initial metadata."""
        metadata = context.invocation_metadata() or ()
        rid = grpc_request_id(metadata, getattr(request, "request_id", "") or "")
        await context.send_initial_metadata(((HEADER, rid),))
        parent = tracing.context_from_metadata(metadata) if tracing.ENABLED else None
        with request_scope(rid, f"{SERVICE_NAME}/{method}", parent, {"rpc.method": method}) \
                if tracing.ENABLED else request_scope_id(rid):
            async with self._call_inner(method, context) as held:
                yield held

    @contextlib.asynccontextmanager
    async def _call_inner(self, method: str, context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[list[Generation]]:
        held: list[Generation] = []
        try:
            self._auth(context)
            yield held
        except ApiError as err:
            await self._abort(context, method, err)
        except asyncio.CancelledError:
            metrics.GRPC_REQUESTS.labels(method, "CANCELLED").inc()
            raise
        except Exception:
            log.exception("%s failed", method)
            await self._abort(context, method, ApiError(500, "internal error in the gateway"))
        finally:
            for gen in held:
                gen.close()
        metrics.GRPC_REQUESTS.labels(method, "OK").inc()

    async def _caller_job(self, method: str, request: object, large: bool,
                          context: grpc.aio.ServicerContext) -> Job:
        """The call's job with what the caller's metadata adds: session, salt, tenant."""
        job = await self._job(method, request, large)
        job.session = _session(context) or job.user
        job.cache_salt = self._salt(context, job.cache_salt)
        job.tenant = self._tenant(context)
        return job

    async def _unary(self, method: str, request: object, context: grpc.aio.ServicerContext
                     ) -> generation_pb2.GenerateResponse:
        large = isinstance(request, _Deferred)
        request = await _materialize(request)
        async with self._call(method, context, request) as held:
            job = await self._caller_job(method, request, large, context)
            with self.gateway.admit(job.tenant):
                gen = Generation(self.gateway, job)
                held.append(gen)
                await gen.start()
                choices = await gen.collect()
                # The id `_call` settled on (the client's only when usable), never the raw field.
                reply = self._response(REQUEST_ID.get() or secrets.token_hex(12))
                out = GrpcOutput(job, await echo_prefixes(job, self.gateway.detokenize))
                for c in choices:
                    out.fill(reply.choices.add(), c, whole=True)
                reply.usage.CopyFrom(usage_message(gen.usage()))
        return reply

    async def _stream(self, method: str, request: object, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        large = isinstance(request, _Deferred)
        request = await _materialize(request)
        async with self._call(method, context, request) as held:
            job = await self._caller_job(method, request, large, context)
            request_id = REQUEST_ID.get() or secrets.token_hex(12)
            with self.gateway.admit(job.tenant):
                gen = Generation(self.gateway, job)
                held.append(gen)
                await gen.start()
                finished, num_choices = 0, gen.num_choices
                head = self._response(request_id)
                out = GrpcOutput(job, await echo_prefixes(job, self.gateway.detokenize))
                async for chunks in gen.chunks():
                    chunks = [c for c in chunks if c.text or c.token_ids or c.finish_reason]
                    if not chunks:
                        continue
                    finished += sum(1 for c in chunks if c.finish_reason)
                    reply = generation_pb2.GenerateResponse()
                    reply.CopyFrom(head)
                    add = reply.choices.add
                    for c in chunks:
                        out.fill(add(), c)
                    if finished == num_choices:  # usage rides on the last message
                        reply.usage.CopyFrom(usage_message(gen.usage()))
                    yield reply

    # -- the service -------------------------------------------------------------------------

    async def Generate(self, request: generation_pb2.GenerateRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> generation_pb2.GenerateResponse:
        return await self._unary("Generate", request, context)

    async def Chat(self, request: generation_pb2.ChatRequest,  # noqa: N802
                   context: grpc.aio.ServicerContext) -> generation_pb2.GenerateResponse:
        return await self._unary("Chat", request, context)

    async def GenerateStream(self, request: generation_pb2.GenerateRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        async for reply in self._stream("GenerateStream", request, context):
            yield reply

    async def ChatStream(self, request: generation_pb2.ChatRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        async for reply in self._stream("ChatStream", request, context):
            yield reply

    async def ListModels(self, request: generation_pb2.ListModelsRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> generation_pb2.ListModelsResponse:
        try:
            self._auth(context)
            info = self.gateway.info
        except ApiError as err:
            await self._abort(context, "ListModels", err)
        metrics.GRPC_REQUESTS.labels("ListModels", "OK").inc()
        return generation_pb2.ListModelsResponse(models=[generation_pb2.ModelCard(
            id=info.name, max_model_len=info.max_model_len, vocab_size=info.vocab_size)])
