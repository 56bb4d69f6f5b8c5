"""The gateway's protocol layer without any network: parsing, validation, mapping, framing."""

from __future__ import annotations

import json

import grpc
import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2
from minisgl_gateway.agent.registry import Formats
from minisgl_gateway.api.generation import ChoiceChunk, TokenLogprob, Usage
from minisgl_gateway.api.grpc_schema import chat_job as grpc_chat_job
from minisgl_gateway.api.grpc_schema import generate_job
from minisgl_gateway.api.job import check_grammar, check_job, choice_seed, resolve_max_tokens
from minisgl_gateway.api.json_body import parse_json
from minisgl_gateway.api.openai_format import DONE, Formatter
from minisgl_gateway.api.openai_schema import build_job
from minisgl_gateway.config import Limits, parse_config
from minisgl_gateway.errors import ApiError, from_upstream

LIMITS = Limits()
CTX, VOCAB = 2048, 1000
MSGS = [{"role": "user", "content": "hi"}]
FORMATS = Formats("hermes", "qwen3")  # the tiny test model's, picked by name


def job_of(endpoint: str, body: dict):
    job, *_ = build_job(endpoint, body, FORMATS)
    check_job(job, LIMITS, CTX, VOCAB)
    check_grammar(job)  # Generation.start runs it, in a thread
    return job


def error_of(endpoint: str, body: object) -> ApiError:
    with pytest.raises(ApiError) as info:
        job_of(endpoint, body)  # type: ignore[arg-type]
    return info.value


def test_parse_json_rejects_bad_bytes() -> None:
    for raw in [b"\xff\xfe{}", b'{"a": NaN}', b'{"a": Infinity}', b"{", b"", b'"\\ud800"',
                b"[" * 100_000 + b"]" * 100_000]:
        with pytest.raises(ApiError) as info:
            parse_json(raw)
        assert info.value.status == 400, raw[:20]
    assert parse_json('{"a": "é"}'.encode()) == {"a": "é"}


def test_chat_params_map_onto_sampling_and_stop() -> None:
    job = job_of("chat", {
        "model": "m", "messages": MSGS + [{"role": "assistant", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "seed": 42, "stop": "END", "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.1, "logprobs": True, "top_logprobs": 3, "ignore_eos": True,
        "min_tokens": 2, "skip_special_tokens": False, "n": 2, "unknown_field": {"x": 1}})
    sp = job.sampling
    assert (sp.max_tokens, sp.top_k, sp.seed, sp.min_tokens, sp.top_logprobs) == (7, 5, 42, 2, 3)
    assert sp.temperature == pytest.approx(0.5) and sp.top_p == pytest.approx(0.9)
    assert sp.logprobs and sp.ignore_eos and job.n == 2
    assert list(job.stop.stop) == ["END"] and job.stop.skip_special_tokens is False
    messages = job.prompts[0].chat.messages
    assert [m.content for m in messages] == ["hi", "a\nb"]
    assert job.max_tokens_default == "context"


def test_completion_prompt_forms() -> None:
    assert len(job_of("completion", {"prompt": "a"}).prompts) == 1
    assert len(job_of("completion", {"prompt": ["a", "b"]}).prompts) == 2
    ids = job_of("completion", {"prompt": [1, 2, 3]}).prompts
    assert list(ids[0].token_ids.ids) == [1, 2, 3]
    assert len(job_of("completion", {"prompt": [[1], [2, 3]]}).prompts) == 2
    job = job_of("completion", {"prompt": "a", "logprobs": 2})
    assert job.sampling.logprobs and job.sampling.top_logprobs == 2
    assert job.max_tokens_default == 16


@pytest.mark.parametrize(("endpoint", "body", "param"), [
    ("chat", {}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("chat", {"messages": MSGS, "max_tokens": -1}, "max_tokens"),
    ("chat", {"messages": MSGS, "max_tokens": "5"}, "max_tokens"),
    ("chat", {"messages": MSGS, "max_tokens": 5.5}, "max_tokens"),
    ("chat", {"messages": MSGS, "max_tokens": CTX + 1}, "max_tokens"),
    ("chat", {"messages": MSGS, "temperature": -1}, "temperature"),
    ("chat", {"messages": MSGS, "temperature": "hot"}, "temperature"),
    ("chat", {"messages": MSGS, "top_p": 0}, "top_p"),
    ("chat", {"messages": MSGS, "n": 0}, "n"),
    ("chat", {"messages": MSGS, "n": 10**6}, "n"),
    ("chat", {"messages": MSGS, "stop": ["x"] * 17}, "stop"),
    ("chat", {"messages": MSGS, "stop": [""]}, "stop"),
    ("chat", {"messages": MSGS, "stop": 5}, "stop"),
    ("chat", {"messages": MSGS, "seed": -1}, "seed"),
    ("chat", {"messages": MSGS, "seed": 2**64}, "seed"),
    ("chat", {"messages": MSGS, "top_logprobs": 3}, "top_logprobs"),
    ("chat", {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"messages": MSGS, "logit_bias": {"1": 101}}, "logit_bias"),
    ("chat", {"messages": MSGS, "logit_bias": {"one": 5}}, "logit_bias"),
    ("chat", {"messages": MSGS, "logit_bias": {str(VOCAB): 5}}, "logit_bias"),
    ("chat", {"messages": MSGS, "stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"messages": MSGS, "response_format": {"type": "yaml"}}, "response_format"),
    ("chat", {"messages": MSGS, "response_format": {"type": "json_object"}, "ignore_eos": True},
     "response_format"),
    ("chat", {"messages": MSGS, "tool_choice": "required"}, "tool_choice"),
    ("chat", {"messages": MSGS, "guided_regex": "a", "regex": "b"}, "regex"),
    ("chat", {"messages": MSGS, "presence_penalty": 3}, "presence_penalty"),
    ("chat", {"messages": MSGS, "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ("completion", {}, "prompt"),
    ("completion", {"prompt": []}, "prompt"),
    ("completion", {"prompt": [[]]}, "prompt"),
    ("completion", {"prompt": [1, "a"]}, "prompt"),
    ("completion", {"prompt": [VOCAB]}, "prompt"),
    ("completion", {"prompt": [2**40]}, "prompt"),
    ("completion", {"prompt": "a", "echo": True, "logprobs": 1}, "echo"),
    ("completion", {"prompt": "a", "ebnf": "start: x"}, "ebnf"),
    ("completion", {"prompt": "a", "best_of": 3}, "best_of"),
    ("completion", {"prompt": "a", "logprobs": 50}, "top_logprobs"),
    ("completion", {"prompt": ["a"] * 65}, "prompt"),
    ("completion", {"prompt": ["a"] * 8, "n": 16}, "n"),
    ("completion", [1, 2], None),
])
def test_invalid_requests_name_the_parameter(endpoint: str, body: object, param: str | None
                                             ) -> None:
    err = error_of(endpoint, body)
    assert err.status == 400
    assert err.param == param, err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_max_tokens_defaults_and_context() -> None:
    chat = job_of("chat", {"messages": MSGS})
    assert resolve_max_tokens(chat, 100, CTX, LIMITS) == CTX - 100
    comp = job_of("completion", {"prompt": "a"})
    assert resolve_max_tokens(comp, 100, CTX, LIMITS) == 16
    explicit = job_of("completion", {"prompt": "a", "max_tokens": 100})
    with pytest.raises(ApiError) as info:
        resolve_max_tokens(explicit, CTX - 50, CTX, LIMITS)
    assert info.value.code == "context_length_exceeded"
    grpc_job = generate_job(generation_pb2.GenerateRequest(text="a"))
    assert resolve_max_tokens(grpc_job, 10, CTX, LIMITS) == 0  # the scheduler's default


def test_choice_seeds_differ_and_stay_in_range() -> None:
    assert choice_seed(5, 0) == 5 and choice_seed(5, 1) == 6
    assert choice_seed(2**63 - 1, 1) == 0


def test_grpc_requests_become_jobs() -> None:
    with pytest.raises(ApiError):
        generate_job(generation_pb2.GenerateRequest())
    with pytest.raises(ApiError):
        grpc_chat_job(generation_pb2.ChatRequest(), FORMATS)
    job = grpc_chat_job(generation_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="developer", content="be brief")], n=3), FORMATS)
    assert job.prompts[0].chat.messages[0].role == "system" and job.n == 3


def test_upstream_errors_map_to_statuses() -> None:
    def status(code: int) -> ApiError:
        return from_upstream(common_pb2.Error(code=code, message="m"), retry_after=2)

    assert status(common_pb2.ERROR_CODE_OVERLOADED).status == 429
    assert status(common_pb2.ERROR_CODE_OVERLOADED).headers() == {"Retry-After": "2"}
    assert status(common_pb2.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED).code == \
        "context_length_exceeded"
    assert status(common_pb2.ERROR_CODE_UNAVAILABLE).status == 503
    assert status(common_pb2.ERROR_CODE_INVALID_ARGUMENT).grpc_code == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert status(common_pb2.ERROR_CODE_OVERLOADED).grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED


def _events(frames: bytes) -> list[object]:
    out = []
    for block in frames.decode().split("\n\n"):
        if block:
            assert block.startswith("data: ")
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_sse_chat_stream_framing() -> None:
    fmt = Formatter("chat", "m")
    lp = [TokenLogprob(7, "hé", -0.5, [(7, "hé", -0.5), (8, "x", -1.0)])]
    frames = fmt.role_chunk(1, True) + b"".join(fmt.stream_chunks(
        [ChoiceChunk(0, "hé", [7], lp, "stop", "END")], True, True))
    frames += fmt.usage_chunk(Usage(3, 1, 0)) + DONE
    role, delta, usage, done = _events(frames)
    assert role["choices"][0]["delta"]["role"] == "assistant" and role["usage"] is None
    assert delta["choices"][0]["delta"]["content"] == "hé"
    assert delta["choices"][0]["finish_reason"] == "stop"
    content = delta["choices"][0]["logprobs"]["content"][0]
    assert content["bytes"] == list("hé".encode()) and len(content["top_logprobs"]) == 2
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 4
    assert done == "[DONE]"


def test_completion_logprobs_offsets() -> None:
    fmt = Formatter("completion", "m")
    items = [TokenLogprob(1, "ab", -1.0), TokenLogprob(2, "c", -2.0, [(2, "c", -2.0)])]
    body = fmt.response([ChoiceChunk(0, "abc", [1, 2], items, "length")], Usage(1, 2, 0), True)
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["text_offset"] == [0, 2] and logprobs["tokens"] == ["ab", "c"]
    assert logprobs["top_logprobs"] == [{}, {"c": -2.0}]


def test_config_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_GATEWAY_API_KEYS", "k1, k2")
    monkeypatch.setenv("MINISGL_GATEWAY_MAX_N", "4")
    config = parse_config(["--port", "9000"])
    assert config.api_keys == ["k1", "k2"] and config.limits.max_n == 4 and config.port == 9000
    assert parse_config(["--api-key", "x"]).api_keys == ["x"]
    with pytest.raises(SystemExit):
        parse_config(["--tls-cert", "c.pem"])
