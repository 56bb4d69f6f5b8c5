"""Hostile values inside otherwise well-formed requests (issue #55): JSON nested deep inside a
string field, gRPC messages with huge item counts, unusable request ids. Each is refused (or
replaced) with a client error naming the field, never a 500 / INTERNAL / UNAVAILABLE."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.e2e

DEEP = "[" * 5000 + "]" * 5000  # past Python's recursion limit when parsed
DEEP_OBJECT = '{"a":' * 100 + "1" + "}" * 100  # parses, but deeper than a body may be
USER = common_pb2.ChatMessage(role="user", content="hi")
ONE_TOKEN = common_pb2.SamplingParams(max_tokens=1)


@pytest.fixture(scope="module")
def stub(gw_stack: object) -> generation_pb2_grpc.GenerationStub:
    channel = grpc.insecure_channel(gw_stack.grpc_target,
                                    options=[("grpc.max_send_message_length", 64 << 20)])
    yield generation_pb2_grpc.GenerationStub(channel)
    channel.close()


def _refused(call: object, request: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=60)  # type: ignore[operator]
    return info.value


@pytest.mark.parametrize("deep", [DEEP, DEEP_OBJECT])
@pytest.mark.parametrize("field", ["guided_json", "response_format"])
def test_deep_json_schema_string_is_a_400(gw_stack: object, field: str, deep: str) -> None:
    body: dict[str, object] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    if field == "guided_json":
        body["guided_json"] = deep
    else:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": deep}}
    reply = httpx.post(f"{gw_stack.http_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "nests" in error["message"] and error["param"].startswith(field), error


@pytest.mark.parametrize("deep", [DEEP, DEEP_OBJECT])
@pytest.mark.parametrize("field", ["tools_json", "chat_template_kwargs_json", "tool_calls_json",
                                   "sampling.grammar.json_schema"])
def test_deep_json_in_grpc_strings_is_invalid_argument(stub: generation_pb2_grpc.GenerationStub,
                                                       field: str, deep: str) -> None:
    request = generation_pb2.ChatRequest(messages=[USER], sampling=ONE_TOKEN)
    if field == "tool_calls_json":
        request.messages.add(role="assistant", tool_calls_json=deep)
        request.messages.add(role="user", content="and?")
    elif field == "sampling.grammar.json_schema":
        request.sampling.grammar.json_schema = deep
    else:
        setattr(request, field, deep)
    for call in (stub.Chat, lambda r, timeout: list(stub.ChatStream(r, timeout=timeout))):
        error = _refused(call, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert field.rsplit(".", 1)[-1] in error.details() and "nests" in error.details()
        assert "Recursion" not in error.details()


@pytest.mark.parametrize("case", ["messages", "tools", "enum", "stop", "logit_bias"])
def test_grpc_item_counts_bounded_like_http(stub: generation_pb2_grpc.GenerationStub,
                                            case: str) -> None:
    """More items than the context window has tokens (2,048 for the tiny model): refused by
    count, quickly, naming the field, as the same array in an HTTP body is."""
    request = generation_pb2.ChatRequest(messages=[USER], sampling=ONE_TOKEN)
    if case == "messages":
        del request.messages[:]
        request.messages.extend([USER] * 50_000)
    elif case == "tools":
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        request.tools_json = json.dumps([tool] * 5000)
    elif case == "enum":
        request.sampling.grammar.json_schema = json.dumps(
            {"type": "string", "enum": [f"v{i}" for i in range(50_000)]})
    elif case == "stop":
        request.stop.stop.extend(["x"] * 50_000)
    else:
        for i in range(5000):
            request.sampling.logit_bias[i] = 1.0
    started = time.monotonic()
    error = _refused(stub.Chat, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "context window" in error.details(), error.details()
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("bad", ["a\nb", "x" * 300, "sp ace"])
def test_grpc_unusable_request_ids_are_replaced(stub: generation_pb2_grpc.GenerationStub,
                                                bad: str) -> None:
    request = generation_pb2.GenerateRequest(text="hi", sampling=ONE_TOKEN, request_id=bad)
    reply = stub.Generate(request, timeout=60)
    assert reply.request_id and reply.request_id != bad
    assert reply.request_id.isalnum() and len(reply.request_id) <= 128, reply.request_id
    streamed = list(stub.GenerateStream(request, timeout=60))
    assert all(r.request_id and r.request_id != bad for r in streamed)
    # A usable id is echoed; metadata wins over the field, as for HTTP's x-request-id.
    request.request_id = "req-ok.1"
    assert stub.Generate(request, timeout=60).request_id == "req-ok.1"
    reply, call = stub.Generate.with_call(request, timeout=60,
                                          metadata=(("x-request-id", "from-meta"),))
    assert reply.request_id == "from-meta"
    assert ("x-request-id", "from-meta") in call.initial_metadata()
