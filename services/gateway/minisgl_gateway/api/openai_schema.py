"""OpenAI request bodies: strict pydantic models (unknown keys allowed and ignored, known keys
type-checked without coercion), and their conversion into a `Job`."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from minisgl_core.proto.minisgl.v1 import common_pb2, tokenizer_pb2
from pydantic import BaseModel, ConfigDict, ValidationError

from minisgl_gateway.agent.registry import Formats
from minisgl_gateway.api import structured, tool_choice
from minisgl_gateway.api.job import CHAT_ROLES, INT32_MAX, Job, check_cache_salt, require_int
from minisgl_gateway.api.json_body import parse_json
from minisgl_gateway.errors import ApiError, invalid

_STRICT = ConfigDict(extra="allow", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ContentPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = _STRICT
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class _Common(BaseModel):
    """Fields both endpoints share (OpenAI's, plus vLLM/SGLang's sampling extensions)."""

    model_config = _STRICT
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: str | None = None  # vLLM's: a prefix-cache namespace
    priority: int | None = None  # vLLM's: lower values are scheduled first (default 0)
    stream: bool | None = None
    stream_options: StreamOptions | None = None


class ChatBody(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-plain"}


def _param(loc: tuple[int | str, ...]) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]
    return ".".join(parts)


def parse_body(model: type[BaseModel], payload: Any) -> Any:
    if not isinstance(payload, dict):
        raise invalid("the request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param(first["loc"])
        if first["type"] == "missing":
            raise invalid(f"'{param}' is a required property", param=param) from None
        raise invalid(f"'{param}': {first['msg']}", param=param) from None


def _sampling(body: _Common, logprobs: bool, top_logprobs: int,
              max_tokens: int | None) -> common_pb2.SamplingParams:
    sp = common_pb2.SamplingParams()
    for name in ("temperature", "top_p", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(sp, name, value)
    for name in ("min_p", "presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(sp, name, value)
    if body.top_k is not None:
        # vLLM's convention: -1 disables top-k, like 0 here.
        sp.top_k = 0 if body.top_k == -1 else require_int(body.top_k, "top_k")
    if max_tokens is not None:
        sp.max_tokens = require_int(max_tokens, "max_tokens", 1)
    if body.min_tokens is not None:
        sp.min_tokens = require_int(body.min_tokens, "min_tokens")
    if body.seed is not None:
        sp.seed = require_int(body.seed, "seed", 0, 2**63 - 1)
    sp.ignore_eos = bool(body.ignore_eos)
    for t in body.stop_token_ids or []:
        sp.stop_token_ids.append(require_int(t, "stop_token_ids"))
    sp.logprobs = logprobs
    sp.top_logprobs = top_logprobs
    return sp


def _stop(body: _Common) -> common_pb2.StopConditions:
    stop = common_pb2.StopConditions()
    if isinstance(body.stop, str):
        stop.stop.append(body.stop)
    elif body.stop:
        stop.stop.extend(body.stop)
    stop.include_stop_str_in_output = bool(body.include_stop_str_in_output)
    if body.skip_special_tokens is not None:
        stop.skip_special_tokens = body.skip_special_tokens
    if body.spaces_between_special_tokens is not None:
        stop.spaces_between_special_tokens = body.spaces_between_special_tokens
    return stop


def _logit_bias(body: _Common, sp: common_pb2.SamplingParams) -> None:
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise invalid(f"logit_bias keys must be token ids (got {key!r})",
                          param="logit_bias") from None
        if not -100.0 <= value <= 100.0:
            raise invalid("logit_bias values must be in [-100, 100]", param="logit_bias")
        sp.logit_bias[require_int(token, "logit_bias")] = value


def _extra_grammar(body: _Common, job: Job, taken: str = "") -> None:
    grammar, key = structured.from_extra(body.model_extra or {})
    if grammar is None:
        return
    if taken:
        raise invalid(f"{key} cannot be combined with {taken}", param=key)
    job.sampling.grammar.CopyFrom(grammar)
    job.grammar_param = key


def _common_checks(body: _Common) -> None:
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed when stream is true",
                      param="stream_options")
    if body.n is not None:
        require_int(body.n, "n", 1, INT32_MAX)


def _message(index: int, msg: Message) -> common_pb2.ChatMessage:
    if msg.role not in CHAT_ROLES:
        raise invalid(f"messages.{index}.role must be one of {sorted(CHAT_ROLES)}",
                      param=f"messages.{index}.role")
    if isinstance(msg.content, list):
        texts = []
        for j, part in enumerate(msg.content):
            if part.type != "text" or part.text is None:
                raise invalid(f"messages.{index}.content.{j}: only text parts are supported "
                              f"(got type {part.type!r})", param=f"messages.{index}.content")
            texts.append(part.text)
        content = "\n".join(texts)
    elif msg.content is None:
        if msg.role != "assistant" or not msg.tool_calls:
            raise invalid(f"messages.{index}.content is required",
                          param=f"messages.{index}.content")
        content = ""
    else:
        content = msg.content
    # "developer" is OpenAI's newer name for the system role; chat templates know "system".
    role = "system" if msg.role == "developer" else msg.role
    out = common_pb2.ChatMessage(role=role, content=content, name=msg.name or "",
                                 tool_call_id=msg.tool_call_id or "")
    if msg.tool_calls:
        out.tool_calls_json = json.dumps(msg.tool_calls)
    return out


def chat_job(body: ChatBody, formats: Formats) -> Job:
    """`formats`: the served model's output parsers (the gateway's, from its flags or the model
    name)."""
    _common_checks(body)
    if not body.messages:
        raise invalid("messages must contain at least one message", param="messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs requires logprobs to be true", param="top_logprobs")
    chat = tokenizer_pb2.ChatInput(messages=[_message(i, m) for i, m in enumerate(body.messages)])
    tools = body.tools or []
    choice = _tool_choice(body, tools)
    if tools and choice.mode != "none":
        chat.tools_json = json.dumps(tools)
    if body.chat_template_kwargs:
        chat.chat_template_kwargs_json = json.dumps(body.chat_template_kwargs)
    top = require_int(body.top_logprobs or 0, "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    job = Job(
        kind="chat", model=body.model or "", prompts=[tokenizer_pb2.TokenizeItem(chat=chat)],
        sampling=_sampling(body, bool(body.logprobs), top, max_tokens), stop=_stop(body),
        n=body.n if body.n is not None else 1, max_tokens_default="context",
        prompt_param="messages", user=body.user or "",
    )
    _logit_bias(body, job.sampling)
    grammar = structured.from_response_format(body.response_format)
    if grammar is not None:
        job.sampling.grammar.CopyFrom(grammar)
        job.grammar_param = "response_format"
    tool_choice.apply(job, tools, choice, formats, parallel=body.parallel_tool_calls is not False)
    _extra_grammar(body, job, job.grammar_param)
    return job


def _tool_choice(body: ChatBody, tools: list[dict[str, Any]]) -> tool_choice.ToolChoice:
    """OpenAI's shapes: a keyword, or `{"type": "function", "function": {"name": ...}}`."""
    choice = body.tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise invalid("tool_choice must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        return tool_choice.resolve(name, tools, "tools", named=True)
    if choice is not None and choice not in tool_choice.KEYWORDS:
        raise invalid("tool_choice must be 'none', 'auto', 'required' or a named function",
                      param="tool_choice")
    return tool_choice.resolve(choice, tools, "tools")


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]
             ) -> list[tokenizer_pb2.TokenizeItem]:
    if isinstance(prompt, str):
        return [tokenizer_pb2.TokenizeItem(text=prompt)]
    if not prompt:
        return []
    if isinstance(prompt[0], str):
        return [tokenizer_pb2.TokenizeItem(text=p) for p in prompt]
    rows: list[list[int]] = [prompt] if isinstance(prompt[0], int) else prompt
    items = []
    for row in rows:
        if not row:
            raise invalid("a token-id prompt must not be empty", param="prompt")
        if any(not 0 <= t <= INT32_MAX for t in row):
            raise invalid("token ids in prompt must be non-negative 32-bit integers",
                          param="prompt")
        items.append(tokenizer_pb2.TokenizeItem(token_ids=common_pb2.TokenIds(ids=row)))
    return items


def completion_job(body: CompletionBody) -> Job:
    _common_checks(body)
    if body.echo and body.logprobs is not None:
        raise invalid("echo with logprobs (prompt logprobs) is not supported", param="echo")
    if (body.model_extra or {}).get("prompt_logprobs") is not None:
        raise invalid("prompt_logprobs is not supported", param="prompt_logprobs")
    if body.suffix:
        raise invalid("suffix is not supported", param="suffix")
    n = body.n if body.n is not None else 1
    if body.best_of is not None and body.best_of != n:
        raise invalid("best_of must equal n (or be left out)", param="best_of")
    top = 0
    if body.logprobs is not None:
        top = require_int(body.logprobs, "logprobs")
    job = Job(
        kind="completion", model=body.model or "", prompts=_prompts(body.prompt),
        sampling=_sampling(body, body.logprobs is not None, top, body.max_tokens),
        stop=_stop(body), n=n, max_tokens_default=16, prompt_param="prompt",
        user=body.user or "", echo=bool(body.echo),
    )
    _logit_bias(body, job.sampling)
    _extra_grammar(body, job)
    return job


def stream_flags(body: _Common) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = bool(body.stream)
    include = bool(stream and body.stream_options and body.stream_options.include_usage)
    return stream, include


Endpoint = Literal["chat", "completion"]


def build_job(endpoint: Endpoint, payload: Any, formats: Formats
              ) -> tuple[Job, bool, bool, str | None]:
    """(job, stream, include_usage, user) for a parsed JSON body; raises ApiError."""
    body = parse_body(ChatBody if endpoint == "chat" else CompletionBody, payload)
    job = chat_job(body, formats) if endpoint == "chat" else completion_job(body)
    stream, include_usage = stream_flags(body)
    job.continuous_usage = bool(stream and body.stream_options
                                and body.stream_options.continuous_usage_stats)
    job.cache_salt = check_cache_salt(body.cache_salt)
    if body.priority is not None:  # an int32 on the wire to the scheduler
        job.priority = require_int(body.priority, "priority", -INT32_MAX - 1, INT32_MAX)
    return job, stream, include_usage, body.user


# Bodies up to this size are parsed on the event loop (a few hundred microseconds at most);
# larger ones in a thread, where the Python-level checks yield the GIL to the loop every few ms.
INLINE_PARSE_BYTES = 64 * 1024


def _parse_request(endpoint: Endpoint, raw: bytes, max_items: int, formats: Formats
                   ) -> tuple[Job, bool, bool]:
    job, stream, include_usage, user = build_job(endpoint, parse_json(raw, max_items), formats)
    job.session = user or ""
    return job, stream, include_usage


async def parse_request(endpoint: Endpoint, raw: bytes, formats: Formats, max_items: int = 0
                        ) -> tuple[Job, bool, bool]:
    """(job, stream, include_usage) for a raw body, without stalling other requests on a big
    one."""
    if len(raw) <= INLINE_PARSE_BYTES:
        return _parse_request(endpoint, raw, max_items, formats)
    return await asyncio.to_thread(_parse_request, endpoint, raw, max_items, formats)


__all__ = ["ApiError", "build_job", "parse_request"]
