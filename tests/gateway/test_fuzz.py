"""Random request bodies never crash the gateway: every answer is a 200 or an OpenAI error with a
4xx status, and the process keeps serving. The gateway runs in front of the real upstreams, with
--max-completion-tokens 32 so that each accepted example stays short."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from .conftest import GatewayProcess, start_gateway

FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logprobs", "top_logprobs", "ignore_eos", "min_tokens",
          "skip_special_tokens", "stream", "stream_options", "user", "echo", "logit_bias",
          "stop_token_ids", "response_format", "tools", "best_of", "suffix"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.integers(-3, 40), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)
messages = st.one_of(values, st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
     "content": st.one_of(st.text(max_size=30), values)}), max_size=3))
prompts = st.one_of(values, st.text(max_size=40), st.lists(st.integers(-5, 300), max_size=6))


@pytest.fixture(scope="module")
def gateway(upstream_targets: dict[str, str], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[GatewayProcess]:
    gw = start_gateway(upstream_targets, tmp_path_factory.mktemp("fuzz"),
                       "--max-completion-tokens", "32")
    yield gw
    gw.stop()


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(endpoint=st.sampled_from(["chat", "completion"]),
       extra=st.dictionaries(st.sampled_from(FIELDS), values, max_size=6),
       msgs=messages, prompt=prompts)
def test_random_bodies_never_crash(gateway: GatewayProcess, endpoint: str, extra: dict,
                                   msgs: object, prompt: object) -> None:
    body = dict(extra)
    if endpoint == "chat":
        body["messages"] = msgs
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    raw = json.dumps(body).encode()  # NaN / Infinity included: they must be refused cleanly
    reply = httpx.post(gateway.http_url + path, content=raw, timeout=30)
    assert reply.status_code in (200, 400, 404, 413), (reply.status_code, body, reply.text)
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert error["message"] and error["type"]
    elif not body.get("stream"):
        assert reply.json()["choices"]


int32 = st.integers(-(2**31), 2**31 - 1)
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
sampling = st.builds(
    common_pb2.SamplingParams, temperature=floats32, top_k=int32, top_p=floats32,
    min_p=floats32, seed=st.integers(0, 2**64 - 1), repetition_penalty=floats32,
    presence_penalty=floats32, frequency_penalty=floats32, max_tokens=int32, min_tokens=int32,
    ignore_eos=st.booleans(), stop_token_ids=st.lists(int32, max_size=3),
    logprobs=st.booleans(), top_logprobs=int32)
grpc_requests = st.builds(
    generation_pb2.GenerateRequest, model=st.sampled_from(["", "tiny", "other"]),
    text=st.text(max_size=30), sampling=sampling, n=st.integers(0, 2**32 - 1),
    stop=st.builds(common_pb2.StopConditions, stop=st.lists(st.text(max_size=5), max_size=3)))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=grpc_requests)
def test_random_grpc_requests_never_crash(gateway: GatewayProcess,
                                          request: generation_pb2.GenerateRequest) -> None:
    with grpc.insecure_channel(gateway.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            reply = stub.Generate(request, timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), \
                (exc.code(), exc.details(), request)
            assert exc.details()
            return
    assert reply.choices


def test_gateway_never_imports_torch() -> None:
    code = ("import sys, minisgl_gateway.server, minisgl_gateway.__main__; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
