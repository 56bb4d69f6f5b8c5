"""The public gRPC API, `minisgl.v1.Generation`, over the same jobs as the HTTP API.

Errors become gRPC status codes (INVALID_ARGUMENT, NOT_FOUND, UNAUTHENTICATED,
RESOURCE_EXHAUSTED with a retry-after trailer, UNAVAILABLE). A cancelled call or an expired
deadline cancels the handler; `Generation.close()` in its `finally` aborts upstream at once."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from minisgl_core import tracing
from minisgl_core.codes import FINISH_TO_PROTO, FinishReason
from minisgl_core.logging import REQUEST_ID
from minisgl_core.proto.minisgl.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    tokenizer_pb2,
)

from minisgl_gateway import metrics
from minisgl_gateway.agent.parsers import ChoiceParser
from minisgl_gateway.api import openai_schema, structured
from minisgl_gateway.api.generation import ChoiceChunk, Generation, Usage
from minisgl_gateway.api.job import Job
from minisgl_gateway.errors import ApiError, invalid
from minisgl_gateway.gateway import Gateway
from minisgl_gateway.request_context import HEADER, grpc_request_id, request_scope
from minisgl_gateway.request_context import only_request_id as request_scope_id

log = logging.getLogger(__name__)

SERVICE_NAME = "minisgl.v1.Generation"
# A choice that ended in error or abort raised before it got here: only these two reach clients.
_FINISH = {r.value: FINISH_TO_PROTO[r] for r in (FinishReason.STOP, FinishReason.LENGTH)}
_ROLES = {"system", "user", "assistant", "tool", "developer"}


class Undecodable:
    """Stands in for a request whose bytes are not a valid message (e.g. bad UTF-8 in a string)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    # grpc's own deserialization failure surfaces as UNKNOWN; the client deserves a 400-class code.
    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return deserialize


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


def _job(method: str, request: object) -> Job:
    if isinstance(request, Undecodable):
        raise invalid(f"the request is not a valid message: {request.reason}")
    if method.startswith("Chat"):
        # The method name says which of the two request messages this one is.
        return chat_job(request)  # type: ignore[arg-type]
    return generate_job(request)  # type: ignore[arg-type]


def generate_job(request: generation_pb2.GenerateRequest) -> Job:
    which = request.WhichOneof("prompt")
    if which is None:
        raise invalid("the prompt is required: set text or token_ids", param="prompt")
    item = (tokenizer_pb2.TokenizeItem(text=request.text) if which == "text"
            else tokenizer_pb2.TokenizeItem(token_ids=request.token_ids))
    if which == "token_ids" and not request.token_ids.ids:
        raise invalid("token_ids must not be empty", param="prompt")
    return Job(kind="completion", model=request.model, prompts=[item],
               sampling=request.sampling, stop=request.stop, n=request.n or 1,
               max_tokens_default="server", prompt_param="prompt",
               request_id=request.request_id, user=request.user, echo=request.echo,
               grammar_param="sampling.grammar")


def chat_job(request: generation_pb2.ChatRequest) -> Job:
    if not request.messages:
        raise invalid("messages must contain at least one message", param="messages")
    messages = []
    for i, m in enumerate(request.messages):
        if m.role not in _ROLES:
            raise invalid(f"messages[{i}].role must be one of {sorted(_ROLES)}",
                          param=f"messages.{i}.role")
        msg = common_pb2.ChatMessage()
        msg.CopyFrom(m)
        if msg.role == "developer":
            msg.role = "system"
        messages.append(msg)
    choice = request.tool_choice or "auto"
    tools = _tools(request.tools_json)
    chat = tokenizer_pb2.ChatInput(messages=messages, tools_json=request.tools_json
                                   if choice != "none" else "",
                                   chat_template_kwargs_json=request.chat_template_kwargs_json)
    job = Job(kind="chat", model=request.model, prompts=[tokenizer_pb2.TokenizeItem(chat=chat)],
              sampling=request.sampling, stop=request.stop, n=request.n or 1,
              max_tokens_default="server", prompt_param="messages",
              request_id=request.request_id, user=request.user,
              grammar_param="sampling.grammar")
    tool_syntax, job.reasoning_parser = openai_schema.FORMATS
    if tools and choice != "none":
        job.tool_parser = tool_syntax
    if choice not in ("none", "auto"):
        names = structured.tool_names(tools)
        if choice != "required" and choice not in names:
            raise invalid(f"tool_choice names {choice!r}, which is not in tools_json",
                          param="tool_choice")
        if not tools:
            raise invalid("tool_choice 'required' needs tools_json", param="tool_choice")
        if request.sampling.HasField("grammar"):
            raise invalid("tool_choice cannot be combined with sampling.grammar",
                          param="tool_choice")
        job.sampling = common_pb2.SamplingParams()
        job.sampling.CopyFrom(request.sampling)
        job.sampling.grammar.CopyFrom(structured.tool_grammar(
            tools, None if choice == "required" else choice, choice == "required", tool_syntax))
        job.grammar_param = "tool_choice"
    return job


def _tools(tools_json: str) -> list[Any]:
    if not tools_json:
        return []
    try:
        tools = json.loads(tools_json)
    except ValueError as exc:
        raise invalid(f"tools_json is not valid JSON: {exc}", param="tools_json") from None
    if not isinstance(tools, list):
        raise invalid("tools_json must be a JSON array", param="tools_json")
    return tools


class _Output:
    """Per response: the parsers of each choice (chat) and the echo prefixes (completions)."""

    def __init__(self, job: Job, echo: list[str] | None) -> None:
        self.syntax = (job.tool_parser, job.reasoning_parser)
        self.parsers: dict[int, ChoiceParser] = {}
        self.echo = echo
        self.echoed: set[int] = set()

    def fill(self, choice: generation_pb2.Choice, chunk: ChoiceChunk, whole: bool = False
             ) -> None:
        """`whole`: a unary answer (tool calls complete, not as deltas)."""
        if self.echo is not None and chunk.index not in self.echoed:
            self.echoed.add(chunk.index)
            chunk.text = self.echo[chunk.index] + chunk.text
        if not any(self.syntax):
            _fill_choice(choice, chunk)
            return
        parser = self.parsers.get(chunk.index)
        if parser is None:
            parser = self.parsers[chunk.index] = ChoiceParser(*self.syntax)
        d = parser.feed(chunk.text, len(chunk.token_ids), final=chunk.finish_reason is not None)
        chunk.text = d.content
        _fill_choice(choice, chunk)
        if d.reasoning:
            choice.reasoning_content = d.reasoning
        if whole:
            for k, call in enumerate(d.calls):
                choice.tool_calls.add(index=k, id=call.id, name=call.name,
                                      arguments=call.arguments)
            return
        for t in d.tools:
            choice.tool_calls.add(index=t.index, id=t.id, name=t.name, arguments=t.arguments)


def _fill_choice(choice: generation_pb2.Choice, chunk: ChoiceChunk) -> None:
    """Fills a Choice in place (`reply.choices.add()`): extending a repeated field with built
    messages copies each one through its serialized bytes."""
    choice.index = chunk.index
    if chunk.text:
        choice.text = chunk.text
    if chunk.token_ids:
        choice.token_ids.extend(chunk.token_ids)
    if chunk.matched_stop:
        choice.matched_stop = chunk.matched_stop
    if chunk.finish_reason:
        choice.finish_reason = _FINISH.get(chunk.finish_reason, common_pb2.FINISH_REASON_STOP)
    for t in chunk.logprobs:
        choice.logprobs.add(token_id=t.token_id, token=t.token, logprob=t.logprob,
                            top_token_ids=[i for i, _, _ in t.top],
                            top_tokens=[s for _, s, _ in t.top],
                            top_logprobs=[p for _, _, p in t.top])


def _usage(usage: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=usage.prompt_tokens,
                            completion_tokens=usage.completion_tokens,
                            cached_tokens=usage.cached_tokens)


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    # -- plumbing ----------------------------------------------------------------------------

    def _auth(self, context: grpc.aio.ServicerContext) -> None:
        metadata = {k: v for k, v in (context.invocation_metadata() or ())}
        value = metadata.get("authorization")
        self.gateway.check_key(value if isinstance(value, str) else None)

    async def _abort(self, context: grpc.aio.ServicerContext, method: str,
                     err: ApiError) -> None:
        metrics.GRPC_REQUESTS.labels(method, err.grpc_code.name).inc()
        trailers = (("retry-after", str(err.retry_after)),) if err.retry_after is not None else ()
        await context.abort(err.grpc_code, err.message, trailing_metadata=trailers)

    async def _echo(self, job: Job) -> list[str] | None:
        if not job.echo:
            return None
        texts = [p.text if p.HasField("text") else
                 await self.gateway.detokenize(list(p.token_ids.ids)) for p in job.prompts]
        return [texts[i // job.n] for i in range(job.num_choices)]

    def _response(self, job: Job, request_id: str) -> generation_pb2.GenerateResponse:
        return generation_pb2.GenerateResponse(request_id=request_id,
                                               model=self.gateway.info.name)

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

    async def _unary(self, method: str, request: object, context: grpc.aio.ServicerContext
                     ) -> generation_pb2.GenerateResponse:
        async with self._call(method, context, request) as held:
            job = _job(method, request)
            job.session = _session(context) or job.user
            with self.gateway.admit():
                gen = Generation(self.gateway, job)
                held.append(gen)
                await gen.start()
                choices = await gen.collect()
                reply = self._response(job, job.request_id or REQUEST_ID.get()
                                       or secrets.token_hex(12))
                out = _Output(job, await self._echo(job))
                for c in choices:
                    out.fill(reply.choices.add(), c, whole=True)
                reply.usage.CopyFrom(_usage(gen.usage()))
        return reply

    async def _stream(self, method: str, request: object, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        async with self._call(method, context, request) as held:
            job = _job(method, request)
            job.session = _session(context) or job.user
            request_id = job.request_id or REQUEST_ID.get() or secrets.token_hex(12)
            with self.gateway.admit():
                gen = Generation(self.gateway, job)
                held.append(gen)
                await gen.start()
                finished, num_choices = 0, gen.num_choices
                head = self._response(job, request_id)
                out = _Output(job, await self._echo(job))
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
                        reply.usage.CopyFrom(_usage(gen.usage()))
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
