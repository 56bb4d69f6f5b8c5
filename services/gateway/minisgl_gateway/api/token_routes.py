"""vLLM's /tokenize and /detokenize (also under /v1/):

    POST /tokenize    {"prompt": str | [ids]} or {"messages": [...], "add_generation_prompt",
                      "tools", "chat_template_kwargs"}, "add_special_tokens", "return_token_strs"
                   -> {"count", "max_model_len", "tokens": [ids], "token_strs": [str] | null}
    POST /detokenize  {"tokens": [ids]} -> {"prompt": str}
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from minisgl_core.proto.minisgl.v1 import common_pb2, tokenizer_pb2
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from minisgl_gateway.api.http_limits import client_gone
from minisgl_gateway.api.json_body import parse_json
from minisgl_gateway.api.openai_schema import _STRICT, Message, _message, parse_body
from minisgl_gateway.errors import from_upstream, invalid
from minisgl_gateway.gateway import Gateway


class TokenizeBody(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[Message] | None = None
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None


class DetokenizeBody(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


def _item(body: TokenizeBody) -> tokenizer_pb2.TokenizeItem:
    if (body.prompt is None) == (body.messages is None):
        raise invalid("give exactly one of prompt and messages", param="prompt")
    item = tokenizer_pb2.TokenizeItem()
    if body.messages is not None:
        chat = item.chat
        chat.messages.extend(_message(i, m) for i, m in enumerate(body.messages))
        if body.add_generation_prompt is not None:
            chat.add_generation_prompt = body.add_generation_prompt
        if body.tools:
            chat.tools_json = json.dumps(body.tools)
        if body.chat_template_kwargs:
            chat.chat_template_kwargs_json = json.dumps(body.chat_template_kwargs)
    elif isinstance(body.prompt, str):
        item.text = body.prompt
    else:
        item.token_ids.CopyFrom(common_pb2.TokenIds(ids=body.prompt or []))
    if body.add_special_tokens is not None:
        item.add_special_tokens = body.add_special_tokens
    return item


def add_token_routes(app: FastAPI, gateway: Gateway) -> None:
    async def read(request: Request, model: type[BaseModel]) -> Any:
        gateway.check_key(request.headers.get("authorization"))
        try:
            raw = await request.body()
        except ClientDisconnect:
            raise client_gone(request) from None
        body = parse_body(model, parse_json(raw, gateway.info.max_model_len))
        gateway.check_model(body.model or "")
        return body

    async def tokenize(request: Request) -> dict[str, Any]:
        body: TokenizeBody = await read(request, TokenizeBody)
        (result,) = await gateway.tokenize_items([_item(body)])
        if result.error.code:
            raise from_upstream(result.error, gateway.limits.retry_after_s,
                                param="messages" if body.messages is not None else "prompt")
        ids = list(result.token_ids)
        strs = None
        if body.return_token_strs:
            table = await gateway.token_strings(ids)
            strs = [table.get(t, "") for t in ids]
        return {"count": len(ids), "max_model_len": gateway.info.max_model_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize(request: Request) -> dict[str, Any]:
        body: DetokenizeBody = await read(request, DetokenizeBody)
        vocab = gateway.info.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise invalid(f"tokens must be in [0, {vocab})", param="tokens")
        return {"prompt": await gateway.detokenize(body.tokens)}

    for prefix in ("", "/v1"):
        app.post(f"{prefix}/tokenize")(tokenize)
        app.post(f"{prefix}/detokenize")(detokenize)
