"""One request, both public APIs: a forced tool call and a reasoning answer sent through the HTTP
API (the real `openai` client) and the public gRPC API against the real stack, greedy, give the
same parsed result: tool call names and arguments, reasoning, content and finish reason (issue 48:
one request pipeline, one output parser, for both)."""

from __future__ import annotations

import json
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.e2e

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "unit": {"enum": ["c", "f"]}}}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
PROMPT = "And God said"
THINK = "<think>[a-z]{2,6}</think>[a-z ]{1,12}"  # a reasoning answer the tiny model must write
# What a parsed choice reduces to on either side: (reasoning, content, [(name, arguments)],
# finish). HTTP's finish_reason "tool_calls" is gRPC's STOP with tool calls.
Parsed = tuple[str, str, list[tuple[str, str]], str]


def _http(stack: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="x", max_retries=0)


def _http_whole(client: openai.OpenAI, **kw: Any) -> Parsed:
    choice = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], temperature=0, **kw
    ).choices[0]
    message = choice.message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    reasoning = getattr(message, "reasoning_content", None) or ""
    finish = "stop" if choice.finish_reason == "tool_calls" else choice.finish_reason
    return reasoning, message.content or "", calls, finish


def _http_stream(client: openai.OpenAI, **kw: Any) -> Parsed:
    reasoning, content, finish = "", "", ""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for chunk in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], temperature=0,
            stream=True, **kw):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.function and tc.function.name:
                    names[tc.index] = tc.function.name
                if tc.function and tc.function.arguments:
                    arguments[tc.index] = arguments.get(tc.index, "") + tc.function.arguments
            if c.finish_reason:
                finish = "stop" if c.finish_reason == "tool_calls" else c.finish_reason
    calls = [(names[i], arguments.get(i, "")) for i in sorted(names)]
    return reasoning, content, calls, finish


_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


def _grpc_request(**kw: Any) -> generation_pb2.ChatRequest:
    grammar = kw.pop("grammar", None)
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens"))
    if grammar is not None:
        sampling.grammar.CopyFrom(grammar)
    return generation_pb2.ChatRequest(
        model="tiny", messages=[common_pb2.ChatMessage(role="user", content=PROMPT)],
        sampling=sampling, **kw)


def _grpc_whole(stub: generation_pb2_grpc.GenerationStub, **kw: Any) -> Parsed:
    choice = stub.Chat(_grpc_request(**kw), timeout=120).choices[0]
    calls = [(c.name, c.arguments) for c in choice.tool_calls]
    return choice.reasoning_content, choice.text, calls, _FINISH[choice.finish_reason]


def _grpc_stream(stub: generation_pb2_grpc.GenerationStub, **kw: Any) -> Parsed:
    reasoning, content, finish = "", "", ""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for reply in stub.ChatStream(_grpc_request(**kw), timeout=120):
        for c in reply.choices:
            reasoning += c.reasoning_content
            content += c.text
            for tc in c.tool_calls:
                if tc.name:
                    names[tc.index] = tc.name
                arguments[tc.index] = arguments.get(tc.index, "") + tc.arguments
            if c.finish_reason:
                finish = _FINISH[c.finish_reason]
    calls = [(names[i], arguments.get(i, "")) for i in sorted(names)]
    return reasoning, content, calls, finish


def test_a_forced_tool_call_parses_the_same_over_http_and_grpc(stack: Any) -> None:
    client = _http(stack)
    tools = [WEATHER, LOOKUP]
    http_kw: dict[str, Any] = dict(tools=tools, max_tokens=150, tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    grpc_kw: dict[str, Any] = dict(tools_json=json.dumps(tools), tool_choice="get_weather",
                                   max_tokens=150)
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        results = {"http": _http_whole(client, **http_kw),
                   "http stream": _http_stream(client, **http_kw),
                   "grpc": _grpc_whole(stub, **grpc_kw),
                   "grpc stream": _grpc_stream(stub, **grpc_kw)}
    reasoning, content, calls, finish = results["http"]
    assert [name for name, _ in calls] == ["get_weather"], results
    jsonschema.validate(json.loads(calls[0][1]), WEATHER["function"]["parameters"])
    assert finish == "stop" and content == "", results
    assert all(r == results["http"] for r in results.values()), results


def test_a_reasoning_answer_parses_the_same_over_http_and_grpc(stack: Any) -> None:
    client = _http(stack)
    http_kw: dict[str, Any] = dict(max_tokens=40, extra_body={"regex": THINK})
    grpc_kw: dict[str, Any] = dict(max_tokens=40, grammar=common_pb2.Grammar(regex=THINK))
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        results = {"http": _http_whole(client, **http_kw),
                   "http stream": _http_stream(client, **http_kw),
                   "grpc": _grpc_whole(stub, **grpc_kw),
                   "grpc stream": _grpc_stream(stub, **grpc_kw)}
    reasoning, content, calls, finish = results["http"]
    assert 2 <= len(reasoning) <= 6 and reasoning.isalpha(), results
    assert content and not calls and finish == "stop", results
    assert all(r == results["http"] for r in results.values()), results
