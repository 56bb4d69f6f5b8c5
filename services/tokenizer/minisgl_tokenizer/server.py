"""gRPC adapters: protobuf in, plain classes, protobuf out; no logic beyond the conversion."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc
from minisgl_core.codes import wire_code
from minisgl_core.proto.minisgl.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

from minisgl_tokenizer import metrics
from minisgl_tokenizer.chat_template import loads_field, message_dict, parse_tools
from minisgl_tokenizer.detokenizer import Detokenizer, StopConditions
from minisgl_tokenizer.model_files import ModelTokenizer
from minisgl_tokenizer.prompt import (
    ChatPrompt,
    ErrorCode,
    ItemError,
    Prompt,
    PromptTokenizer,
    TextPrompt,
    TokenIdsPrompt,
)
from minisgl_tokenizer.request_trace import StreamRequests, tokenize_scope

log = logging.getLogger(__name__)


def prompt_from_proto(item: tokenizer_pb2.TokenizeItem) -> Prompt | ItemError:
    kind = item.WhichOneof("input")
    if kind == "text":
        add = item.add_special_tokens if item.HasField("add_special_tokens") else True
        return TextPrompt(item.text, add)
    if kind == "token_ids":
        return TokenIdsPrompt(list(item.token_ids.ids))
    if kind == "chat":
        chat = item.chat
        try:
            messages = [message_dict(m.role, m.content, m.name, m.tool_call_id, m.tool_calls_json)
                        for m in chat.messages]
            tools = parse_tools(chat.tools_json)
            kwargs = loads_field(chat.chat_template_kwargs_json or "{}",
                                 "chat_template_kwargs_json")
            if not isinstance(kwargs, dict):
                raise ValueError("chat_template_kwargs must be a JSON object")
        except ValueError as exc:
            return ItemError(ErrorCode.INVALID_ARGUMENT, str(exc))
        add_gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        add = item.add_special_tokens if item.HasField("add_special_tokens") else False
        return ChatPrompt(messages, tools, add_gen, add, kwargs)
    return ItemError(ErrorCode.INVALID_ARGUMENT, "the item has no input (text, token_ids or chat)")


def stop_from_proto(stop: common_pb2.StopConditions) -> StopConditions:
    return StopConditions(
        stop=tuple(stop.stop),
        include_stop_str_in_output=stop.include_stop_str_in_output,
        skip_special_tokens=stop.skip_special_tokens if stop.HasField("skip_special_tokens")
        else True,
        spaces_between_special_tokens=stop.spaces_between_special_tokens
        if stop.HasField("spaces_between_special_tokens") else True,
    )


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, model: ModelTokenizer) -> None:
        self.model = model
        self.prompts = PromptTokenizer(model)

    def Tokenize(self, request: tokenizer_pb2.TokenizeRequest,  # noqa: N802 - gRPC method name
                 context: grpc.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        with tokenize_scope(context.invocation_metadata(), len(request.items)):
            return self._tokenize(request, context)

    def _tokenize(self, request: tokenizer_pb2.TokenizeRequest,
                  context: grpc.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        started = time.perf_counter()
        items = [prompt_from_proto(item) for item in request.items]
        for item in request.items:
            metrics.TOKENIZE_ITEMS.labels(item.WhichOneof("input") or "none").inc()
        try:
            results = self.prompts.tokenize(items, request.max_prompt_tokens)
        except Exception as exc:  # a bug must not take the service down; the caller sees why
            log.exception("Tokenize failed")
            context.abort(grpc.StatusCode.INTERNAL, f"tokenizer error: {exc}")
        reply = tokenizer_pb2.TokenizeResponse()
        tokens = 0
        for result in results:
            out = reply.results.add()
            if result.error is not None:
                out.error.code = wire_code(result.error.code)
                out.error.message = result.error.message
                metrics.TOKENIZE_ERRORS.labels(result.error.code.name).inc()
            else:
                out.token_ids.extend(result.token_ids)
                tokens += len(result.token_ids)
        metrics.PROMPT_TOKENS.labels(self.model.name).inc(tokens)
        metrics.TOKENIZE_SECONDS.observe(time.perf_counter() - started)
        return reply

    def GetTokenizerInfo(self, request: tokenizer_pb2.GetTokenizerInfoRequest,  # noqa: N802
                         context: grpc.ServicerContext) -> tokenizer_pb2.GetTokenizerInfoResponse:
        m = self.model
        return tokenizer_pb2.GetTokenizerInfoResponse(
            model_name=m.name, vocab_size=m.vocab_size, eos_token_ids=m.eos_token_ids,
            max_model_len=m.max_model_len, has_chat_template=bool(m.chat),
        )

    def DecodeTokens(self, request: tokenizer_pb2.DecodeTokensRequest,  # noqa: N802
                     context: grpc.ServicerContext) -> tokenizer_pb2.DecodeTokensResponse:
        if request.join:
            return tokenizer_pb2.DecodeTokensResponse(
                texts=[self.prompts.decode_joined(list(request.token_ids))])
        return tokenizer_pb2.DecodeTokensResponse(
            texts=self.prompts.decode_each(list(request.token_ids)))


class DetokenizerServicer(detokenizer_pb2_grpc.DetokenizerServicer):
    """One `Detokenizer` per stream: a stream is one caller's set of requests.

    SIGTERM (`drain`): a caller's stream lives as long as the caller, so the detokenizer ends each
    stream itself once no request on it is mid-generation (bounded by the drain timeout); the
    gateway then fails nothing and reopens the stream to another detokenizer."""

    def __init__(self, model: ModelTokenizer) -> None:
        self.model = model
        self._lock = threading.Lock()
        self._streams = 0
        self._idle = threading.Condition(self._lock)
        self._open: dict[grpc.ServicerContext, Detokenizer] = {}
        self._closing = False

    def Detokenize(self, request_iterator: Iterator[detokenizer_pb2.DetokenizeRequest],  # noqa: N802
                   context: grpc.ServicerContext) -> Iterator[detokenizer_pb2.DetokenizeResponse]:
        if self._closing:  # a caller reconnecting during the drain must go elsewhere
            context.abort(grpc.StatusCode.UNAVAILABLE, "the detokenizer is shutting down")
        detok = Detokenizer(self.model.tokenizer, self.model.special_text)
        self._opened()
        with self._lock:
            self._open[context] = detok
        active = 0
        watch = StreamRequests()
        try:
            for request in request_iterator:
                started = time.perf_counter()
                if watch.active:
                    watch.observe(request.updates)
                stops, tokens = detok.stats.stops, detok.stats.tokens
                reply = detokenizer_pb2.DetokenizeResponse()
                add = reply.deltas.add
                try:
                    for u in request.updates:
                        d = detok.update(u.rid, u.token_ids, u.finished,
                                         stop_from_proto(u.stop) if u.HasField("stop") else None)
                        if d.stopped:
                            add(rid=d.rid, text=d.text, stopped=True, matched_stop=d.matched_stop,
                                num_tokens=d.num_tokens)
                        else:  # hot path: set fields, cheaper than keyword construction
                            delta = add()
                            delta.rid = d.rid
                            if d.text:
                                delta.text = d.text
                except Exception as exc:  # a bug: end this stream with the reason, keep serving
                    log.exception("Detokenize step failed")
                    context.abort(grpc.StatusCode.INTERNAL, f"detokenizer error: {exc}")
                yield reply
                metrics.DETOK_TOKENS.labels(self.model.name).inc(detok.stats.tokens - tokens)
                if detok.stats.stops != stops:
                    metrics.DETOK_STOPS.inc(detok.stats.stops - stops)
                metrics.DETOK_REQUESTS.inc(detok.active - active)
                active = detok.active
                metrics.DETOK_STEP_SECONDS.observe(time.perf_counter() - started)
        finally:
            watch.close()
            with self._lock:
                self._open.pop(context, None)
            metrics.DETOK_REQUESTS.dec(active)
            self._closed()

    def _opened(self) -> None:
        with self._lock:
            self._streams += 1
        metrics.DETOK_STREAMS.inc()

    def _closed(self) -> None:
        with self._lock:
            self._streams -= 1
            self._idle.notify_all()
        metrics.DETOK_STREAMS.dec()

    def drain(self, timeout: float) -> None:
        """Shutdown hook: end each stream once none of its requests is mid-generation (callers
        reopen elsewhere); past `timeout` the server's stop cuts the rest."""
        deadline = time.monotonic() + timeout
        self._closing = True
        while time.monotonic() < deadline:
            with self._lock:
                if not self._streams:
                    return
                quiet = [ctx for ctx, detok in self._open.items() if not detok.active]
            for ctx in quiet:
                ctx.cancel()
            time.sleep(0.05)
