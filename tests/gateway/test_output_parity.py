"""The same choice text through the HTTP formatter and the gRPC one gives the same parse (both
read api/choice_output.py): reasoning, content, tool calls and finish, whole and streamed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, tokenizer_pb2
from minisgl_gateway.api.generation import ChoiceChunk, Usage
from minisgl_gateway.api.grpc_format import GrpcOutput
from minisgl_gateway.api.job import Job
from minisgl_gateway.api.openai_format import Formatter

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ur", "unit": "c"}}\n</tool_call>'
TEXTS = {
    "tool call": ("hermes", "qwen3", CALL),
    "reasoning": ("hermes", "qwen3", "<think>why not</think>\n\nLet there be light"),
    "both": ("hermes", "qwen3", "<think>a plan</think>\nI will look.\n" + CALL),
    "plain": ("hermes", "qwen3", "In the beginning"),
    "mistral": ("mistral", "", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]'),
    "llama3": ("llama3", "", '{"name": "f", "parameters": {"a": 1}}'),
    "deepseek_r1": ("hermes", "deepseek_r1", "thought</think>said"),
}
Parsed = tuple[str, str | None, list[tuple[str, str]], str]


def _pieces(text: str, size: int) -> list[ChoiceChunk]:
    parts = [text[i:i + size] for i in range(0, len(text), size)]
    chunks = [ChoiceChunk(0, p, [1]) for p in parts]
    chunks[-1].finish_reason = "stop"
    return chunks


def _job(tool: str, reasoning: str) -> Job:
    return Job(kind="chat", model="", prompts=[tokenizer_pb2.TokenizeItem(text="x")],
               sampling=common_pb2.SamplingParams(), tool_parser=tool, reasoning_parser=reasoning)


def _http_whole(tool: str, reasoning: str, text: str) -> Parsed:
    fmt = Formatter("chat", "m", tool, reasoning)
    for c in _pieces(text, 3):
        fmt.observe(c)
    body = fmt.response([ChoiceChunk(0, text, [1] * len(text), [], "stop")], Usage(1, 1, 0),
                        False)
    choice = body["choices"][0]
    message = choice["message"]
    calls = [(t["function"]["name"], t["function"]["arguments"])
             for t in message.get("tool_calls", [])]
    finish = "stop" if choice["finish_reason"] == "tool_calls" else choice["finish_reason"]
    return message.get("reasoning_content") or "", message["content"] or "", calls, finish


def _http_stream(tool: str, reasoning: str, text: str, size: int) -> Parsed:
    fmt = Formatter("chat", "m", tool, reasoning)
    reasoning_text, content, finish = "", "", ""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for c in _pieces(text, size):
        for frame in fmt.stream_chunks([c], False, False):
            body: dict[str, Any] = json.loads(frame.decode().removeprefix("data: "))
            for ch in body["choices"]:
                delta = ch["delta"]
                reasoning_text += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
                for t in delta.get("tool_calls", []):
                    if t["function"].get("name"):
                        names[t["index"]] = t["function"]["name"]
                    args[t["index"]] = args.get(t["index"], "") + t["function"]["arguments"]
                if ch["finish_reason"]:
                    finish = "stop" if ch["finish_reason"] == "tool_calls" else ch["finish_reason"]
    return reasoning_text, content, [(names[i], args[i]) for i in sorted(names)], finish


def _grpc(tool: str, reasoning: str, text: str, size: int | None) -> Parsed:
    """`size` None: a unary answer (the whole text in one chunk)."""
    out = GrpcOutput(_job(tool, reasoning), None)
    chunks = [ChoiceChunk(0, text, [1] * len(text), [], "stop")] if size is None \
        else _pieces(text, size)
    reasoning_text, content, finish = "", "", ""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for c in chunks:
        choice = generation_pb2.Choice()
        out.fill(choice, c, whole=size is None)
        reasoning_text += choice.reasoning_content
        content += choice.text
        for t in choice.tool_calls:
            if t.name:
                names[t.index] = t.name
            args[t.index] = args.get(t.index, "") + t.arguments
        if choice.finish_reason == common_pb2.FINISH_REASON_STOP:
            finish = "stop"
    return reasoning_text, content, [(names[i], args[i]) for i in sorted(names)], finish


@pytest.mark.parametrize("case", sorted(TEXTS))
def test_both_apis_parse_a_choice_the_same(case: str) -> None:
    tool, reasoning, text = TEXTS[case]
    http = _http_whole(tool, reasoning, text)
    assert http[3] == "stop"
    for size in (1, 4, 1000):
        assert _http_stream(tool, reasoning, text, size) == http, size
        assert _grpc(tool, reasoning, text, size) == http, size
    assert _grpc(tool, reasoning, text, None) == http
    if "call" in case or case in ("mistral", "llama3"):
        assert http[2] and json.loads(http[2][0][1])
