"""Per-API-key quotas through a real gateway process: 429 + Retry-After over HTTP and
RESOURCE_EXHAUSTED + retry-after over gRPC, other keys unaffected, the token budget refilling;
and the `priority` field on both APIs."""

from __future__ import annotations

import time
from typing import Any

import grpc
import httpx
import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.e2e

COMP = "/v1/completions"


def comp(**extra: Any) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": 4, **extra}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def check_quota_error(reply: httpx.Response, retry_after: str | None = None) -> None:
    assert reply.status_code == 429, reply.text
    error = reply.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert int(reply.headers["retry-after"]) >= 1
    if retry_after is not None:
        assert reply.headers["retry-after"] == retry_after


def test_in_flight_quota_per_key(spawn_gateway) -> None:
    gw = spawn_gateway("--api-key", "k1", "--api-key", "k2", "--key-max-in-flight", "1",
                       "--retry-after", "2")
    card = httpx.get(gw.http_url + "/v1/models", headers=auth("k1"), timeout=30).json()
    budget = card["data"][0]["max_model_len"] - 64  # long enough to still run during the check
    body = comp(max_tokens=budget, ignore_eos=True, stream=True)
    with httpx.stream("POST", gw.http_url + COMP, json=body, headers=auth("k1"),
                      timeout=120) as holding:
        assert holding.status_code == 200, holding.read()
        lines = holding.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)  # k1's one request is running
        check_quota_error(httpx.post(gw.http_url + COMP, json=comp(), headers=auth("k1"),
                                     timeout=60), "2")
        assert httpx.post(gw.http_url + COMP, json=comp(), headers=auth("k2"),
                          timeout=60).status_code == 200
        with grpc.insecure_channel(gw.grpc_target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.GenerateRequest(
                text="a", sampling=common_pb2.SamplingParams(max_tokens=2))
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(request, metadata=(("authorization", "Bearer k1"),), timeout=30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(info.value.trailing_metadata()).get("retry-after") == "2"
            assert stub.Generate(request, metadata=(("authorization", "Bearer k2"),),
                                 timeout=60).choices[0].token_ids
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the key's slot frees once its stream is gone
        if httpx.post(gw.http_url + COMP, json=comp(), headers=auth("k1"),
                      timeout=60).status_code == 200:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the key's in-flight count was not released")


def test_tokens_per_minute_refuses_then_refills(spawn_gateway) -> None:
    # 600 a minute: 10 a second. The bucket starts full; a 700-token request overdraws it by
    # 100, which takes about 10 s to refill.
    gw = spawn_gateway("--key-tokens-per-minute", "600")
    big = comp(prompt=[5] * 60, max_tokens=640, ignore_eos=True)
    first = httpx.post(gw.http_url + COMP, json=big, headers=auth("a"), timeout=120)
    assert first.status_code == 200, first.text
    used = first.json()["usage"]["total_tokens"]
    assert used == 700
    reply = httpx.post(gw.http_url + COMP, json=comp(), headers=auth("a"), timeout=60)
    check_quota_error(reply)
    assert 5 <= int(reply.headers["retry-after"]) <= 11  # about 100 tokens at 10 a second
    # Another key has its own budget; a request without a key is one more "key".
    assert httpx.post(gw.http_url + COMP, json=comp(), headers=auth("b"),
                      timeout=60).status_code == 200
    assert httpx.post(gw.http_url + COMP, json=comp(), timeout=60).status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # refilled at 10 tokens a second
        reply = httpx.post(gw.http_url + COMP, json=comp(), headers=auth("a"), timeout=60)
        if reply.status_code == 200:
            break
        check_quota_error(reply)
        time.sleep(0.5)
    else:
        pytest.fail("the token budget did not refill")


def test_priority_field_on_both_apis(gw_stack) -> None:
    url = gw_stack.http_url
    for value in (-5, 0, 7):
        reply = httpx.post(url + COMP, json=comp(priority=value), timeout=60)
        assert reply.status_code == 200, reply.text
    for bad in ("high", 1.5, 2**31):
        reply = httpx.post(url + COMP, json=comp(priority=bad), timeout=60)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "priority"
    with grpc.insecure_channel(gw_stack.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(
            text="a", priority=-3, sampling=common_pb2.SamplingParams(max_tokens=2))
        assert stub.Generate(request, timeout=60).choices[0].token_ids
