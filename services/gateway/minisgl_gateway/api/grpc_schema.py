"""minisgl.v1.Generation requests -> jobs: the gRPC twin of openai_schema.py. Chat requests share
the rules for tools and tool_choice with the HTTP API (tool_choice.py), and the bounds an HTTP body
gets from the context window (json_body.py): no repeated field with more items than the window has
tokens, no string longer than a prompt that fits, JSON inside strings no deeper than an HTTP body.
They are checked before any per-item work."""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, tokenizer_pb2

from minisgl_gateway.agent.registry import Formats
from minisgl_gateway.api import tool_choice
from minisgl_gateway.api.job import CHAT_ROLES, Job, check_cache_salt
from minisgl_gateway.api.json_body import parse_json_field, string_limit
from minisgl_gateway.errors import invalid


class Undecodable:
    """Stands in for a request whose bytes are not a valid message (e.g. bad UTF-8 in a string)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def job_for(method: str, request: object, formats: Formats, max_items: int = 0) -> Job:
    """The job of one call; `method` says which of the two request messages `request` is.
    `max_items` > 0 (the context window): the bounds above."""
    if isinstance(request, Undecodable):
        raise invalid(f"the request is not a valid message: {request.reason}")
    job = (chat_job(request, formats, max_items)  # type: ignore[arg-type]
           if method.startswith("Chat") else generate_job(request, max_items))  # type: ignore[arg-type]
    # proto3 strings have no "unset": empty means no salt.
    job.cache_salt = check_cache_salt(getattr(request, "cache_salt", "") or None)
    job.priority = int(getattr(request, "priority", 0))  # int32: every value is valid
    return job


def _count(items: Sized, param: str, max_items: int) -> None:
    if max_items and len(items) > max_items:
        raise invalid(f"{param} has {len(items)} items; at most {max_items} are allowed (the "
                      "context window)", param=param, code="context_length_exceeded")


def _size(text: str, param: str, max_items: int) -> None:
    if max_items and len(text) > string_limit(max_items):
        raise invalid(f"{param} has {len(text)} characters; no prompt longer than "
                      f"{string_limit(max_items)} fits the context window", param=param,
                      code="context_length_exceeded")


def _check_common(sampling: common_pb2.SamplingParams, stop: common_pb2.StopConditions,
                  max_items: int) -> None:
    """The fields both requests share: repeated fields counted, strings measured, a JSON schema
    parsed with the body's bounds (a 200k-entry enum is refused here, not by the grammar
    compiler)."""
    _count(stop.stop, "stop", max_items)
    for s in stop.stop:
        _size(s, "stop", max_items)
    _count(sampling.stop_token_ids, "sampling.stop_token_ids", max_items)
    _count(sampling.logit_bias, "sampling.logit_bias", max_items)
    if sampling.HasField("grammar"):
        g = sampling.grammar
        kind = g.WhichOneof("spec")
        if kind == "json_schema":
            parse_json_field(g.json_schema, "sampling.grammar.json_schema", max_items)
        elif kind in ("regex", "lark"):
            _size(getattr(g, kind), f"sampling.grammar.{kind}", max_items)


def generate_job(request: generation_pb2.GenerateRequest, max_items: int = 0) -> Job:
    _check_common(request.sampling, request.stop, max_items)
    _size(request.text, "prompt", max_items)
    # One id more than fits is still a context-length error (check_job words it).
    _count(request.token_ids.ids, "prompt", max_items and max_items + 1)
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


def chat_job(request: generation_pb2.ChatRequest, formats: Formats, max_items: int = 0) -> Job:
    """`formats`: the served model's output parsers (the gateway's, from its flags or the model
    name)."""
    if not request.messages:
        raise invalid("messages must contain at least one message", param="messages")
    _count(request.messages, "messages", max_items)
    _check_common(request.sampling, request.stop, max_items)
    messages = []
    for i, m in enumerate(request.messages):
        if m.role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}",
                          param=f"messages.{i}.role")
        _size(m.content, f"messages.{i}.content", max_items)
        if m.tool_calls_json:  # parsed again by the tokenizer: refused here, not there
            calls = parse_json_field(m.tool_calls_json, f"messages.{i}.tool_calls_json",
                                     max_items)
            if not isinstance(calls, list):
                raise invalid(f"messages.{i}.tool_calls_json must be a JSON array",
                              param=f"messages.{i}.tool_calls_json")
        msg = common_pb2.ChatMessage()
        msg.CopyFrom(m)
        if msg.role == "developer":
            msg.role = "system"
        messages.append(msg)
    tools = _tools(request.tools_json, max_items)
    if request.chat_template_kwargs_json:
        kwargs = parse_json_field(request.chat_template_kwargs_json, "chat_template_kwargs_json",
                                  max_items)
        if not isinstance(kwargs, dict):
            raise invalid("chat_template_kwargs_json must be a JSON object",
                          param="chat_template_kwargs_json")
    # The proto's tool_choice: a keyword, or any other string names the function to call.
    choice = tool_choice.resolve(request.tool_choice or None, tools, "tools_json")
    chat = tokenizer_pb2.ChatInput(messages=messages, tools_json=request.tools_json
                                   if request.tool_choice != "none" else "",
                                   chat_template_kwargs_json=request.chat_template_kwargs_json)
    job = Job(kind="chat", model=request.model, prompts=[tokenizer_pb2.TokenizeItem(chat=chat)],
              sampling=request.sampling, stop=request.stop, n=request.n or 1,
              max_tokens_default="server", prompt_param="messages",
              request_id=request.request_id, user=request.user,
              grammar_param="sampling.grammar")
    tool_choice.apply(job, tools, choice, formats)
    return job


def _tools(tools_json: str, max_items: int) -> list[Any]:
    if not tools_json:
        return []
    tools = parse_json_field(tools_json, "tools_json", max_items)
    if not isinstance(tools, list):
        raise invalid("tools_json must be a JSON array", param="tools_json")
    return tools
