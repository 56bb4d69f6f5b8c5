"""Tool-call and reasoning parsers: any split of the text into stream deltas gives what the whole
text gives."""

from __future__ import annotations

import json

import pytest
from minisgl_gateway.agent.base import assemble
from minisgl_gateway.agent.choice_parser import ChoiceParser
from minisgl_gateway.agent.registry import default_parsers


def _whole(syntax: tuple[str, str], text: str) -> tuple[str, str, list[tuple[str, str]]]:
    d = ChoiceParser(*syntax).feed(text, final=True)
    return d.reasoning, d.content, [(c.name, c.arguments) for c in d.calls]


def _streamed(syntax: tuple[str, str], parts: list[str]) -> tuple[str, str,
                                                                   list[tuple[str, str]]]:
    p = ChoiceParser(*syntax)
    reasoning, content, tools = "", "", []
    named: set[int] = set()
    for i, part in enumerate(parts):
        d = p.feed(part, final=i == len(parts) - 1)
        reasoning += d.reasoning
        content += d.content
        for t in d.tools:
            assert t.name or t.index in named, "a call's name comes before its arguments"
            named.add(t.index)
        tools += d.tools
    return reasoning, content, [(c.name, c.arguments) for c in assemble(tools)]


CASES = [
    (("hermes", "qwen3"), '<think>\nhmm, rain?</think>\n\nLet me look.<tool_call>\n{"name": "w", '
     '"arguments": {"city": "Ur"}}\n</tool_call>\n<tool_call>\n{"name": "t", "arguments": {}}'
     "\n</tool_call>",
     ("\nhmm, rain?", "Let me look.", [("w", '{"city": "Ur"}'), ("t", "{}")])),
    (("hermes", "qwen3"), "plain <tool text, no call", ("", "plain <tool text, no call", [])),
    (("hermes", ""), '<tool_call>{"name":"a","arguments":{"x":{"y":"}"}}}</tool_call>'
     '<tool_call>{"arguments":{"k":[1]},"name":"b"}</tool_call>',
     ("", "", [("a", '{"x":{"y":"}"}}'), ("b", '{"k": [1]}')])),
    (("hermes", ""), "<tool_call>not json</tool_call>",
     ("", "<tool_call>not json</tool_call>", [])),
    (("llama3", ""), '<|python_tag|>{"name": "w", "parameters": {"a": 1}}',
     ("", "", [("w", '{"a": 1}')])),
    (("llama3", ""), "{not a call", ("", "{not a call", [])),
    (("mistral", ""), 'ok[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", '
     '"arguments": {}}]', ("", "ok", [("a", '{"x": 1}'), ("b", "{}")])),
    (("", "deepseek_r1"), "thinking</think>answer", ("thinking", "answer", [])),
    (("", "qwen3"), "<think>never closed", ("never closed", "", [])),
]


@pytest.mark.parametrize(("syntax", "text", "expected"), CASES)
def test_every_split_matches_the_whole(syntax: tuple[str, str], text: str,
                                       expected: tuple[str, str, list[tuple[str, str]]]) -> None:
    assert _whole(syntax, text) == expected
    for cut in range(1, len(text)):
        for cut2 in (cut + 1, cut + 7):
            parts = [text[:cut], text[cut:cut2], text[cut2:]]
            assert _streamed(syntax, parts) == expected, parts
    assert _streamed(syntax, list(text)) == expected


def test_calls_get_distinct_ids_and_parsers_follow_the_model() -> None:
    d = ChoiceParser("hermes", "").feed(
        '<tool_call>{"name":"a","arguments":{}}</tool_call><tool_call>{"name":"a",'
        '"arguments":{}}</tool_call>', final=True)
    assert len({c.id for c in d.calls}) == 2 and json.loads(d.calls[0].arguments) == {}
    assert default_parsers("Meta-Llama-3.1-8B") == ("llama3", "")
    assert default_parsers("Qwen3-0.6B") == ("hermes", "qwen3")
    assert default_parsers("Mistral-7B") == ("mistral", "")


def test_plain_chat_streams_leave_the_parsers_after_the_first_text() -> None:
    """Chat streams of a reasoning model return to the plain-text fast path once the answer is
    known not to think (or has finished thinking)."""
    p = ChoiceParser("", "qwen3")
    p.feed("Hello")
    assert p.passthrough
    p = ChoiceParser("", "qwen3")
    p.feed("<thi")
    assert not p.passthrough
    p.feed("nk>a</think>")
    assert not p.passthrough  # blank lines after </think> may still come
    p.feed("\nok")
    assert p.passthrough
    assert not ChoiceParser("hermes", "qwen3").passthrough  # tool calls may come at any point


@pytest.mark.parametrize(("pieces", "expected"), [
    (["<", "th", "ink>", "a", "b", "</think>", "X", "Y"], 6),
    (["<think>ab</think>XY"], 1),
    (["Hel", "lo"], 0),
    (["<", "b>"], 0),
])
def test_reasoning_tokens_are_the_chunks_that_reasoned(pieces: list[str], expected: int) -> None:
    p = ChoiceParser("", "qwen3")
    for i, piece in enumerate(pieces):
        p.feed(piece, 1, final=i == len(pieces) - 1)
    assert p.reasoning_tokens == expected
