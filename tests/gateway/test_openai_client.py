"""The official `openai` Python client against the running stack: chat and completions, streaming
and not, n > 1, stop strings, seeds, logprobs, and usage numbers checked against the tokenizer."""

from __future__ import annotations

import grpc
import openai
import pytest
from minisgl_core.proto.minisgl.v1 import (
    common_pb2,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "Who made the heaven and the earth?"}]
PROMPT = "In the beginning God created"


@pytest.fixture(scope="module")
def client(gw_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw_stack.http_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def tokenized_len(gw_stack, item: tokenizer_pb2.TokenizeItem) -> int:
    with grpc.insecure_channel(gw_stack.target("tokenizer")) as channel:
        reply = tokenizer_pb2_grpc.TokenizerStub(channel).Tokenize(
            tokenizer_pb2.TokenizeRequest(items=[item]), timeout=30)
    return len(reply.results[0].token_ids)


def test_chat_non_stream_usage_matches_tokenizer(client, model, gw_stack) -> None:
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12,
                                           temperature=0, logprobs=True)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    chat = tokenizer_pb2.ChatInput(messages=[common_pb2.ChatMessage(**m) for m in QUESTION])
    assert reply.usage.prompt_tokens == tokenized_len(gw_stack,
                                                      tokenizer_pb2.TokenizeItem(chat=chat))
    # One logprob entry per generated token: the completion count is the real token count.
    assert reply.usage.completion_tokens == len(choice.logprobs.content) <= 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_equals_non_stream_and_reports_usage(client, model) -> None:
    args = dict(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**args)
    pieces, usage, finish = [], None, None
    for chunk in client.chat.completions.create(**args, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_stream_and_non_stream(client, model, gw_stack) -> None:
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0,
                                      logprobs=2)
    choice = whole.choices[0]
    assert choice.text and len(choice.logprobs.tokens) == whole.usage.completion_tokens
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert whole.usage.prompt_tokens == tokenized_len(gw_stack,
                                                      tokenizer_pb2.TokenizeItem(text=PROMPT))
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    assert text == choice.text


def test_batch_prompts_and_n(client, model) -> None:
    reply = client.completions.create(model=model, prompt=[PROMPT, "And God said"], n=2,
                                      max_tokens=6, temperature=0.8, seed=3)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    assert reply.usage.completion_tokens > 0
    chat = client.chat.completions.create(model=model, messages=QUESTION, n=3, max_tokens=6,
                                          temperature=1.0)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in chat.choices)
    indices = set()
    for chunk in client.chat.completions.create(model=model, messages=QUESTION, n=3,
                                                max_tokens=6, stream=True):
        indices |= {c.index for c in chunk.choices}
    assert indices == {0, 1, 2}


def test_seed_reproducible(client, model) -> None:
    def sample() -> list[str]:
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                          temperature=1.0, seed=1234, n=2)
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    first = sample()
    assert sample() == first
    stream = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=1234, stream=True))
    assert stream == first[0]


def test_stop_string_cuts_text_and_counts(client, model) -> None:
    base = dict(model=model, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0)
    full = client.completions.create(**base)
    text = full.choices[0].text
    # A stop string from the middle of the greedy answer: generation must end right before it.
    words = [w for w in text.split(" ") if len(w.strip()) >= 2]
    assert len(words) >= 3, f"greedy answer too short for a stop test: {text!r}"
    stop = words[len(words) // 2].strip()
    cut = client.completions.create(**base, stop=[stop, "@@never@@"])
    choice = cut.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[:text.index(stop)]
    assert cut.usage.completion_tokens == len(choice.logprobs.tokens)
    assert cut.usage.completion_tokens < full.usage.completion_tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **{**base, "logprobs": None}, stop=stop, stream=True))
    assert streamed == choice.text


def test_chat_logprobs(client, model) -> None:
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs),
                                              abs=1e-3)
        assert entry.bytes == list(entry.token.encode())


def test_unknown_model_and_bad_params_raise_openai_errors(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", messages=QUESTION, temperature=-3)
    assert info.value.body["param"] == "temperature"
