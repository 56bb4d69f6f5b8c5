"""JSON nested past the bound inside a chat item's string fields is the item's INVALID_ARGUMENT,
never a RecursionError (which surfaced as UNAVAILABLE/INTERNAL at the gateway)."""

from __future__ import annotations

import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2, tokenizer_pb2
from minisgl_tokenizer.prompt import ErrorCode
from minisgl_tokenizer.server import prompt_from_proto

DEEP = "[" * 5000 + "]" * 5000
DEEP_OBJECT = '{"a":' * 100 + "1" + "}" * 100


@pytest.mark.parametrize("deep", [DEEP, DEEP_OBJECT])
@pytest.mark.parametrize("field", ["tools_json", "chat_template_kwargs_json", "tool_calls_json"])
def test_deep_json_is_invalid_argument(field: str, deep: str) -> None:
    chat = tokenizer_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content="hi")])
    if field == "tool_calls_json":
        chat.messages.add(role="assistant", tool_calls_json=deep)
    else:
        setattr(chat, field, deep)
    result = prompt_from_proto(tokenizer_pb2.TokenizeItem(chat=chat))
    assert getattr(result, "code", None) == ErrorCode.INVALID_ARGUMENT, result
    assert "nests" in result.message
