"""minisgl.v1.Generation requests -> jobs: the gRPC twin of openai_schema.py. Chat requests share
the rules for tools and tool_choice with the HTTP API (tool_choice.py)."""

from __future__ import annotations

import json
from typing import Any

from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, tokenizer_pb2

from minisgl_gateway.agent.registry import Formats
from minisgl_gateway.api import tool_choice
from minisgl_gateway.api.job import CHAT_ROLES, Job, check_cache_salt
from minisgl_gateway.errors import invalid


class Undecodable:
    """Stands in for a request whose bytes are not a valid message (e.g. bad UTF-8 in a string)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def job_for(method: str, request: object, formats: Formats) -> Job:
    """The job of one call; `method` says which of the two request messages `request` is."""
    if isinstance(request, Undecodable):
        raise invalid(f"the request is not a valid message: {request.reason}")
    job = (chat_job(request, formats) if method.startswith("Chat")  # type: ignore[arg-type]
           else generate_job(request))  # type: ignore[arg-type]
    # proto3 strings have no "unset": empty means no salt.
    job.cache_salt = check_cache_salt(getattr(request, "cache_salt", "") or None)
    return job


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


def chat_job(request: generation_pb2.ChatRequest, formats: Formats) -> Job:
    """`formats`: the served model's output parsers (the gateway's, from its flags or the model
    name)."""
    if not request.messages:
        raise invalid("messages must contain at least one message", param="messages")
    messages = []
    for i, m in enumerate(request.messages):
        if m.role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}",
                          param=f"messages.{i}.role")
        msg = common_pb2.ChatMessage()
        msg.CopyFrom(m)
        if msg.role == "developer":
            msg.role = "system"
        messages.append(msg)
    tools = _tools(request.tools_json)
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
