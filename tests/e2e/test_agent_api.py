"""Structured outputs, tool calls, reasoning and the extra request fields through the real stack
and the real `openai` client (issue 28)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.e2e

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "unit": {"enum": ["c", "f"]}}}}}
USER = [{"role": "user", "content": "And God said"}]


def _client(stack: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="x", max_retries=0)


def test_json_schema_valid_in_100_of_100_seeded_samples(stack: Any) -> None:
    client = _client(stack)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}

    def ask(seed: int) -> list[Any]:
        reply = client.chat.completions.create(model="tiny", messages=USER, n=10, seed=seed,
                                               temperature=1.0, max_tokens=80,
                                               response_format=fmt)  # type: ignore[arg-type]
        return reply.choices

    with ThreadPoolExecutor(4) as pool:
        choices = [c for batch in pool.map(ask, range(0, 100, 10)) for c in batch]
    assert len(choices) == 100
    for c in choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content or ""), PERSON)
    assert len({c.message.content for c in choices}) > 10  # sampled, not one forced answer


def test_tool_choice_required_streamed_and_whole_agree(stack: Any) -> None:
    client = _client(stack)
    args: dict[str, Any] = dict(model="tiny", messages=USER, tools=[WEATHER],
                                tool_choice="required", seed=7, temperature=1.0, max_tokens=150,
                                parallel_tool_calls=False)
    whole = client.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments),
                        WEATHER["function"]["parameters"])

    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    first_fields: list[str] = []
    fragments = 0
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                if tc.function and tc.function.name:
                    names[tc.index] = tc.function.name
                    first_fields.append("name")
                if tc.function and tc.function.arguments:
                    assert tc.index in names, "the name comes before the arguments"
                    arguments[tc.index] = arguments.get(tc.index, "") + tc.function.arguments
                    fragments += 1
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert names == {0: "get_weather"}
    assert arguments[0] == calls[0].function.arguments
    assert fragments > 1, "arguments stream as they are generated"


def test_named_tool_choice_and_tool_result_messages(stack: Any) -> None:
    client = _client(stack)
    messages = [*USER,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city":"Ur"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "hot"}]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], max_tokens=150, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = reply.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]


def test_think_text_goes_to_reasoning_content(stack: Any) -> None:
    client = _client(stack)
    # The tiny model never thinks: a regex makes it write the markers.
    extra = {"regex": "<think>[a-z ]{3,12}</think>[A-Z][a-z]{2,8}"}
    whole = client.chat.completions.create(model="tiny", messages=USER, max_tokens=40, seed=1,
                                           extra_body=extra)
    msg = whole.choices[0].message
    reasoning = getattr(msg, "reasoning_content", None)
    assert reasoning and "<think>" not in reasoning and "think>" not in (msg.content or "")
    assert msg.content and msg.content[0].isupper()
    assert whole.usage and whole.usage.completion_tokens_details
    thinking = whole.usage.completion_tokens_details.reasoning_tokens or 0
    assert 0 < thinking < whole.usage.completion_tokens  # the answer's tokens are not reasoning
    streamed = {"reasoning": "", "content": ""}
    usage = None
    for chunk in client.chat.completions.create(model="tiny", messages=USER, max_tokens=40,
                                                seed=1, extra_body=extra, stream=True,
                                                stream_options={"include_usage": True}):
        for c in chunk.choices:
            streamed["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            streamed["content"] += c.delta.content or ""
        usage = chunk.usage or usage
    assert streamed == {"reasoning": reasoning, "content": msg.content}
    assert usage and usage.completion_tokens_details
    assert usage.completion_tokens_details.reasoning_tokens == thinking


def test_logit_bias_bans_and_forces_a_token(stack: Any) -> None:
    client = _client(stack)
    prompt = "In the beginning"
    base = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
    ids = httpx.post(f"{stack.http_url}/tokenize", timeout=30, json={
        "prompt": base.choices[0].text, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1
    banned = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(ids[0]): -100})
    assert banned.choices[0].text != base.choices[0].text
    forced = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                       logit_bias={"300": 100})
    word = httpx.post(f"{stack.http_url}/detokenize", json={"tokens": [300, 300, 300]},
                      timeout=30).json()["prompt"]
    assert forced.choices[0].text == word


def test_echo_returns_the_prompt(stack: Any) -> None:
    client = _client(stack)
    reply = client.completions.create(model="tiny", prompt="And the earth", max_tokens=4,
                                      temperature=0, echo=True)
    assert reply.choices[0].text.startswith("And the earth")
    assert len(reply.choices[0].text) > len("And the earth")


def test_tokenize_round_trips_with_detokenize(stack: Any) -> None:
    text = "Let there be light: and there was light."
    tok = httpx.post(f"{stack.http_url}/tokenize", timeout=30,
                     json={"prompt": text, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) > 3 and len(tok["token_strs"]) == tok["count"]
    back = httpx.post(f"{stack.http_url}/detokenize", json={"tokens": tok["tokens"]}, timeout=30)
    assert back.json() == {"prompt": text}
    chat = httpx.post(f"{stack.http_url}/v1/tokenize", timeout=30,
                      json={"messages": USER, "add_generation_prompt": True}).json()
    assert chat["count"] > tok["count"] // 4
    # The tiny model's template ignores enable_thinking; the variable still reaches it.
    same = httpx.post(f"{stack.http_url}/v1/tokenize", timeout=30, json={
        "messages": USER, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert same["tokens"] == chat["tokens"]


@pytest.mark.parametrize(("body", "needle"), [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "nonsense"),
    ({"regex": "a(+"}, "regex"),
    ({"tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "yaml"}}, "yaml"),
])
def test_invalid_grammar_is_a_400_naming_the_problem(stack: Any, body: dict[str, Any],
                                                      needle: str) -> None:
    reply = httpx.post(f"{stack.http_url}/v1/chat/completions", timeout=30,
                       json={"messages": USER, "max_tokens": 4, **body})
    assert reply.status_code == 400, reply.text
    assert needle in reply.json()["error"]["message"]


def test_public_grpc_api_grammar_tools_reasoning_echo(stack: Any) -> None:
    import grpc
    from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        sampling = common_pb2.SamplingParams(
            max_tokens=80, seed=5, grammar=common_pb2.Grammar(json_schema=json.dumps(PERSON)),
            logit_bias={300: -100.0})
        reply = stub.Generate(generation_pb2.GenerateRequest(
            text="And God said", sampling=sampling, echo=True, user="u1"), timeout=60)
        text = reply.choices[0].text
        assert text.startswith("And God said")
        jsonschema.validate(json.loads(text[len("And God said"):]), PERSON)
        assert 300 not in reply.choices[0].token_ids

        chat = generation_pb2.ChatRequest(
            messages=[common_pb2.ChatMessage(role="user", content="Speak")],
            sampling=common_pb2.SamplingParams(max_tokens=150, seed=2),
            tools_json=json.dumps([WEATHER]), tool_choice="get_weather")
        parts = [tc for m in stub.ChatStream(chat, timeout=60) for c in m.choices
                 for tc in c.tool_calls]
        # The first part names the call, the others carry argument fragments.
        assert parts[0].name == "get_weather" and parts[0].id and len(parts) > 2
        assert all(p.index == 0 and not p.name and not p.id for p in parts[1:])
        arguments = "".join(p.arguments for p in parts)
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
        whole = stub.Chat(chat, timeout=60).choices[0].tool_calls
        assert [(c.name, c.arguments) for c in whole] == [("get_weather", arguments)]

        think = generation_pb2.ChatRequest(
            messages=[common_pb2.ChatMessage(role="user", content="Speak")],
            sampling=common_pb2.SamplingParams(max_tokens=40, seed=2, grammar=common_pb2.Grammar(
                regex="<think>[a-z]{2,6}</think>ok")))
        whole = stub.Chat(think, timeout=60).choices[0]
        assert whole.text == "ok" and 2 <= len(whole.reasoning_content) <= 6

        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(generation_pb2.GenerateRequest(text="a", sampling=common_pb2.SamplingParams(
                grammar=common_pb2.Grammar(regex="a(+"))), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "regex" in (err.value.details() or "")


def test_continuous_usage_stats_in_every_chunk(stack: Any) -> None:
    client = _client(stack)
    seen = []
    for chunk in client.completions.create(
            model="tiny", prompt="In the beginning", max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}):  # type: ignore[typeddict-unknown-key]
        assert chunk.usage is not None
        seen.append(chunk.usage.completion_tokens)
    assert seen == sorted(seen) and seen[-1] == 6 and len(seen) >= 6
