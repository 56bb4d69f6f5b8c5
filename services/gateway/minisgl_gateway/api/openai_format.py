"""OpenAI response bodies and SSE chunks built from choice chunks (chat and completions)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from json.encoder import encode_basestring  # what json.dumps(ensure_ascii=False) does to a str
from typing import Any

from minisgl_gateway.agent.base import ToolCall
from minisgl_gateway.api.choice_output import ChoiceOutputs
from minisgl_gateway.api.generation import ChoiceChunk, TokenLogprob, Usage
from minisgl_gateway.errors import ApiError


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def sse(payload: Any) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                               separators=(",", ":"))
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")


def usage_body(usage: Usage, reasoning_tokens: int | None = None) -> dict[str, Any]:
    body = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def error_event(error: ApiError) -> bytes:
    return sse(error.body())


class Formatter:
    """One per response: fixed id, creation time and model name."""

    def __init__(self, kind: str, model: str, tool_parser: str = "", reasoning_parser: str = "",
                 echo: list[str] | None = None) -> None:
        """Chat answers go through the tool-call / reasoning parsers named (agent/);
        `echo`: completions, the text each choice starts with."""
        self.kind = kind
        self.model = model
        chat = kind == "chat"
        self.out = ChoiceOutputs(tool_parser if chat else "", reasoning_parser if chat else "",
                                 echo)
        # stream_options.continuous_usage_stats: the usage so far, in every chunk.
        self.usage_now: Callable[[], Usage] | None = None
        self.id = new_id(kind)
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # completions text_offset per choice (streaming)
        self._templates: dict[bool, tuple[str, str, str]] = {}  # include_usage -> text chunk

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- logprobs ----------------------------------------------------------------------------

    @staticmethod
    def _chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
        def entry(text: str, lp: float) -> dict[str, Any]:
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [
            {**entry(t.token, t.logprob), "top_logprobs": [entry(s, p) for _, s, p in t.top]}
            for t in items]}

    def _completion_logprobs(self, index: int, items: list[TokenLogprob]) -> dict[str, Any]:
        offsets = []
        offset = self._offsets.get(index, 0)
        for t in items:
            offsets.append(offset)
            offset += len(t.token)
        self._offsets[index] = offset
        return {
            "tokens": [t.token for t in items],
            "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{s: p for _, s, p in t.top} for t in items],
            "text_offset": offsets,
        }

    def _logprobs(self, chunk: ChoiceChunk, wanted: bool) -> dict[str, Any] | None:
        if not wanted:
            return None
        if self.kind == "chat":
            return self._chat_logprobs(chunk.logprobs)
        return self._completion_logprobs(chunk.index, chunk.logprobs)

    # -- whole answers -----------------------------------------------------------------------

    @property
    def parsing(self) -> bool:
        return self.out.parsing

    def reasoning_tokens(self) -> int | None:
        return self.out.reasoning_tokens()

    @staticmethod
    def _call_json(call: ToolCall) -> dict[str, Any]:
        return {"id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def observe(self, c: ChoiceChunk) -> None:
        """A unary answer's chunks as they come (`Generation.collect`)."""
        self.out.observe(c)

    def response(self, choices: list[ChoiceChunk], usage: Usage, logprobs: bool) -> dict[str, Any]:
        out = []
        for c in choices:
            item: dict[str, Any] = {"index": c.index}
            if self.parsing:
                d = self.out.whole(c)
                message: dict[str, Any] = {"role": "assistant",
                                           "content": d.content if d.content or not d.calls
                                           else None}
                if self.out.reasoning:
                    message["reasoning_content"] = d.reasoning or None
                if d.calls:
                    message["tool_calls"] = [self._call_json(t) for t in d.calls]
                item["message"] = message
            elif self.kind == "chat":
                item["message"] = {"role": "assistant", "content": c.text}
            else:
                self.out.echo_into(c)
                item["text"] = c.text
            item["logprobs"] = self._logprobs(c, logprobs)
            item["finish_reason"] = self.out.finish_reason(c)
            item["stop_reason"] = c.matched_stop or None
            out.append(item)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": out,
                "usage": usage_body(usage, self.reasoning_tokens())}

    # -- streams -----------------------------------------------------------------------------

    def _chunk(self, choices: list[dict[str, Any]], include_usage: bool) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = {**self._head(obj), "choices": choices}
        if self.usage_now is not None:
            body["usage"] = usage_body(self.usage_now(), self.reasoning_tokens())
        elif include_usage:
            body["usage"] = None
        return sse(body)

    def role_chunk(self, num_choices: int, include_usage: bool) -> bytes:
        """Chat streams open with the assistant role for every choice."""
        choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(num_choices)]
        return self._chunk(choices, include_usage)

    def stream_chunks(self, chunks: list[ChoiceChunk], logprobs: bool,
                      include_usage: bool) -> list[bytes]:
        out = []
        parsers = self.out.parsers if self.out.parsing else None
        echoing = self.out.echoing
        for c in chunks:
            if parsers is not None:
                parser = parsers.get(c.index)
                if parser is None or not parser.passthrough:
                    out += self._parsed_chunks(c, logprobs, include_usage)
                    continue
            if echoing:
                self.out.echo_into(c)
            if not c.text and not c.finish_reason and not c.logprobs:
                continue  # nothing visible yet (e.g. half a UTF-8 character)
            if not c.finish_reason and not logprobs and self.usage_now is None:  # most chunks
                head, mid, tail = self._templates.get(include_usage) or self._template(
                    include_usage)
                out.append(f"{head}{c.index}{mid}{encode_basestring(c.text)}{tail}".encode())
                continue
            item: dict[str, Any] = {"index": c.index}
            if self.kind == "chat":
                item["delta"] = {"content": c.text} if c.text else {}
            else:
                item["text"] = c.text
            item["logprobs"] = self._logprobs(c, logprobs)
            item["finish_reason"] = c.finish_reason
            if c.finish_reason:
                item["stop_reason"] = c.matched_stop or None
            out.append(self._chunk([item], include_usage))
        return out

    def _parsed_chunks(self, c: ChoiceChunk, logprobs: bool, include_usage: bool) -> list[bytes]:
        """Chat deltas through the parsers: reasoning, content, then each completed tool call
        as a name delta and an arguments delta."""
        d = self.out.parse(c)
        deltas: list[dict[str, Any]] = []
        if d.reasoning:
            deltas.append({"reasoning_content": d.reasoning})
        if d.content:
            deltas.append({"content": d.content})
        for t in d.tools:
            if t.name:
                deltas.append({"tool_calls": [{"index": t.index, "id": t.id, "type": "function",
                                               "function": {"name": t.name, "arguments": ""}}]})
            if t.arguments:
                deltas.append({"tool_calls": [{"index": t.index,
                                               "function": {"arguments": t.arguments}}]})
        lp = self._logprobs(c, logprobs)
        out = []
        for i, delta in enumerate(deltas):
            item = {"index": c.index, "delta": delta, "logprobs": lp if i == 0 else None,
                    "finish_reason": None}
            out.append(self._chunk([item], include_usage))
        if c.finish_reason:
            item = {"index": c.index, "delta": {}, "logprobs": None if deltas else lp,
                    "finish_reason": self.out.finish_reason(c),
                    "stop_reason": c.matched_stop or None}
            out.append(self._chunk([item], include_usage))
        return out

    def _template(self, include_usage: bool) -> tuple[str, str, str]:
        """The SSE event of a text delta without logprobs or finish reason, as the text around
        the choice index and the JSON string of the text: the same bytes `_chunk` writes for it,
        without building and serializing the dicts for every token of every stream."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        head = json.dumps(self._head(obj), ensure_ascii=False, separators=(",", ":"))
        text_key, close = ('"delta":{"content":', "}") if self.kind == "chat" else ('"text":', "")
        usage = ',"usage":null' if include_usage else ""
        template = (f'data: {head[:-1]},"choices":[{{"index":', f",{text_key}",
                    f'{close},"logprobs":null,"finish_reason":null}}]{usage}}}\n\n')
        self._templates[include_usage] = template
        return template

    def usage_chunk(self, usage: Usage) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return sse({**self._head(obj), "choices": [],
                    "usage": usage_body(usage, self.reasoning_tokens())})


def model_card(name: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "minisgl",
            "max_model_len": max_model_len}
