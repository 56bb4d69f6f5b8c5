"""Grammars hold under load: many concurrent constrained requests with different grammars (JSON
schemas, regexes, named tool calls), sampled with seeds, every output checked against its own
grammar; through the five services and through the in-process `LLM` with overlap on and off.

Request 9's draw hits the hash whose noise was +inf before (seed 9, position 299; see
tests/worker/test_draw_noise_bounds.py): its reply broke its schema on the old code."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import pytest
from minisgl_core.sampling import GrammarSpec, SamplingParams
from openai import AsyncOpenAI

from tests.conftest import TINY_MODEL

pytestmark = pytest.mark.e2e
N = 24  # through the stack
N_IN_PROCESS = 12  # each LLM run starts an engine: fewer requests, still request 9


def schema(i: int) -> dict[str, Any]:
    props = {f"k{i}_{j}": ({"type": "integer", "minimum": 0, "maximum": 999} if j % 2 else
                           {"type": "string", "maxLength": 12}) for j in range(3)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


REGEX = r"(yes|no), [a-z]{2,8}\."
TOOL = {"type": "function", "function": {"name": "send_mail", "parameters": {
    "type": "object", "properties": {"to": {"type": "string", "maxLength": 16},
                                     "urgent": {"type": "boolean"}},
    "required": ["to", "urgent"], "additionalProperties": False}}}


def prompt(i: int) -> str:
    # Prompts of different lengths: several requests' prefills share (and split) steps.
    return "In the beginning God created the heaven and the earth. " * (i % 7 * 12) + f"Go {i}"


async def one(client: AsyncOpenAI, i: int) -> str | None:
    """None if request i's output keeps its grammar, else what went wrong."""
    kind = i % 6
    common: dict[str, Any] = dict(model="tiny", max_tokens=120, temperature=0.8, seed=i,
                                  messages=[{"role": "user", "content": prompt(i)}])
    if kind == 4:
        r = await client.chat.completions.create(**common, extra_body={"regex": REGEX})
        text = r.choices[0].message.content or ""
        return None if re.fullmatch(REGEX, text) else f"{i}: regex broken: {text!r}"
    if kind == 5:
        r = await client.chat.completions.create(
            **common, tools=[TOOL], tool_choice={"type": "function",
                                                  "function": {"name": "send_mail"}})
        calls = r.choices[0].message.tool_calls or []
        if len(calls) != 1 or calls[0].function.name != "send_mail":
            return f"{i}: no send_mail call: {r.choices[0].message!r}"
        try:
            jsonschema.validate(json.loads(calls[0].function.arguments),
                                TOOL["function"]["parameters"])
        except (ValueError, jsonschema.ValidationError) as exc:
            return f"{i}: arguments broken: {calls[0].function.arguments!r} ({exc})"
        return None
    s = schema(i % 8)
    r = await client.chat.completions.create(**common, response_format={
        "type": "json_schema", "json_schema": {"name": f"s{i % 8}", "schema": s}})
    text = r.choices[0].message.content or ""
    try:
        jsonschema.validate(json.loads(text), s)
    except (ValueError, jsonschema.ValidationError):
        return f"{i}: schema broken ({r.choices[0].finish_reason}): {text!r}"
    return None


def test_concurrent_grammars_through_the_stack(stack: Any) -> None:
    async def run() -> list[str]:
        async with AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="x",
                               timeout=300) as client:
            found = await asyncio.gather(*(one(client, i) for i in range(N)))
        return [f for f in found if f]

    broken = asyncio.run(run())
    assert not broken, broken


@pytest.mark.parametrize("disable_overlap", [False, True])
def test_concurrent_grammars_in_process(disable_overlap: bool) -> None:
    from minisgl import LLM
    from minisgl_tokenizer import ChatPrompt, ModelTokenizer, PromptTokenizer

    tok = PromptTokenizer(ModelTokenizer.load(TINY_MODEL))
    ids = [r.token_ids for r in tok.tokenize(
        [ChatPrompt([{"role": "user", "content": prompt(i)}]) for i in range(N_IN_PROCESS)])]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=120,
                             grammar=GrammarSpec("json_schema", json.dumps(schema(i % 8))))
              for i in range(N_IN_PROCESS)]
    llm = LLM(str(TINY_MODEL), disable_overlap=disable_overlap, max_prefill_tokens=2048)
    try:
        outs = llm.generate(ids, params)
    finally:
        llm.close()
    broken = []
    for i, out in enumerate(outs):
        try:
            jsonschema.validate(json.loads(out["text"]), schema(i % 8))
        except (ValueError, jsonschema.ValidationError):
            broken.append((i, out["finish_reason"], out["text"]))
    assert not broken, broken
