"""Malformed and hostile HTTP requests: each gets its documented status and an OpenAI error body,
never a 500 or a hang, and the stack keeps serving afterwards."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e

MSGS = [{"role": "user", "content": "hello"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@dataclass
class Case:
    name: str
    path: str
    body: Any = None  # JSON-encoded unless `raw` is given
    raw: bytes | None = None
    status: int = 400
    code: str | None = None
    param: str | None = None
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": MSGS, "max_tokens": 4, **extra}


def comp(**extra: Any) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": 4, **extra}


CASES = [
    Case("bad json", CHAT, raw=b'{"messages": [}'),
    Case("truncated json", COMP, raw=b'{"prompt": "a"'),
    Case("empty body", COMP, raw=b""),
    Case("json array body", CHAT, body=[1, 2, 3]),
    Case("invalid utf-8", CHAT, raw=b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    Case("lone surrogate", COMP, raw=b'{"prompt": "\\ud800"}'),
    Case("NaN literal", CHAT, raw=b'{"messages": [], "temperature": NaN}'),
    Case("deep nesting", COMP, raw=b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
    Case("missing messages", CHAT, body={"max_tokens": 4}, param="messages"),
    Case("messages not a list", CHAT, body={"messages": "hi"}, param="messages"),
    Case("empty messages", CHAT, body={"messages": []}, param="messages"),
    Case("unknown role", CHAT, body={"messages": [{"role": "root", "content": "x"}]},
         param="messages.0.role"),
    Case("content wrong type", CHAT, body={"messages": [{"role": "user", "content": 42}]},
         param="messages.0.content"),
    Case("image content part", CHAT, body={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, param="messages.0.content"),
    Case("negative max_tokens", CHAT, body=chat(max_tokens=-5), param="max_tokens"),
    Case("string max_tokens", COMP, body=comp(max_tokens="10"), param="max_tokens"),
    Case("float max_tokens", COMP, body=comp(max_tokens=1.5), param="max_tokens"),
    Case("max_tokens 2**70", COMP, body=comp(max_tokens=2**70), param="max_tokens"),
    Case("max_tokens over context", COMP, body=comp(max_tokens=10_000_000),
         param="max_tokens", code="context_length_exceeded"),
    Case("temperature too high", CHAT, body=chat(temperature=500), param="temperature"),
    Case("temperature string", CHAT, body=chat(temperature="warm"), param="temperature"),
    Case("top_p zero", CHAT, body=chat(top_p=0), param="top_p"),
    Case("top_k negative", COMP, body=comp(top_k=-7), param="top_k"),
    Case("huge n", CHAT, body=chat(n=100_000), param="n"),
    Case("zero n", COMP, body=comp(n=0), param="n"),
    Case("too many stops", CHAT, body=chat(stop=[f"s{i}" for i in range(50)]), param="stop"),
    Case("stop wrong type", CHAT, body=chat(stop=[1, 2]), param="stop"),
    Case("top_logprobs too many", CHAT, body=chat(logprobs=True, top_logprobs=99),
         param="top_logprobs"),
    Case("top_logprobs without logprobs", CHAT, body=chat(top_logprobs=2),
         param="top_logprobs"),
    Case("negative seed", COMP, body=comp(seed=-1), param="seed"),
    Case("presence_penalty range", COMP, body=comp(presence_penalty=9), param="presence_penalty"),
    Case("min_tokens over max_tokens", COMP, body=comp(min_tokens=9, max_tokens=2),
         param="min_tokens"),
    Case("logit_bias out of range", CHAT, body=chat(logit_bias={"5": 300}), param="logit_bias"),
    Case("echo with prompt logprobs", COMP, body=comp(echo=True, logprobs=1), param="echo"),
    Case("invalid json schema", CHAT, body=chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        param="response_format"),
    Case("empty prompt list", COMP, body=comp(prompt=[]), param="prompt"),
    Case("mixed prompt list", COMP, body=comp(prompt=[1, "a"]), param="prompt"),
    Case("token id out of vocab", COMP, body=comp(prompt=[2**30]), param="prompt"),
    Case("stream_options without stream", CHAT,
         body=chat(stream_options={"include_usage": True}), param="stream_options"),
    Case("stream not bool", CHAT, body=chat(stream="yes"), param="stream"),
    Case("prompt over context window", COMP, body=comp(prompt="word " * 40_000),
         code="context_length_exceeded", param="prompt"),
    Case("unknown model", CHAT, body=chat(model="gpt-17"), status=404, code="model_not_found",
         param="model"),
    Case("10 MB body", COMP, raw=json.dumps(comp(prompt="x" * (10 * 1024 * 1024))).encode(),
         status=413, code="request_too_large"),
    Case("unknown route", "/v1/engines", body={}, status=404),
    Case("wrong method", CHAT, method="GET", status=405),
]


def check_error(reply: httpx.Response, status: int, code: str | None = None,
                param: str | None = None) -> dict[str, Any]:
    assert reply.status_code == status, reply.text[:500]
    body = reply.json()
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if code is not None:
        assert error["code"] == code, body
    if param is not None:
        assert error["param"] == param, body
    return error


def send(client: httpx.Client, case: Case) -> httpx.Response:
    headers = {"content-type": "application/json", **case.headers}
    content = case.raw if case.raw is not None else (
        json.dumps(case.body).encode() if case.body is not None else None)
    return client.request(case.method, case.path, content=content, headers=headers)


def test_bad_requests_get_documented_errors(gw_stack) -> None:
    assert len(CASES) >= 25
    with httpx.Client(base_url=gw_stack.http_url, timeout=60) as client:
        for case in CASES:
            reply = send(client, case)
            try:
                check_error(reply, case.status, case.code, case.param)
            except AssertionError as exc:
                raise AssertionError(f"case {case.name!r}: {exc}") from None
        # Still serving, both protocols' front door intact.
        ok = client.post(COMP, json=comp(max_tokens=3))
        assert ok.status_code == 200, ok.text
        assert client.get("/ready").status_code == 200


def test_api_keys(spawn_gateway) -> None:
    gw = spawn_gateway("--api-key", "sk-one", env={"MINISGL_GATEWAY_API_KEYS": "ignored"})
    with httpx.Client(base_url=gw.http_url, timeout=60) as client:
        check_error(client.post(CHAT, json=chat()), 401, code="missing_api_key")
        check_error(client.post(CHAT, json=chat(), headers={"Authorization": "Bearer sk-two"}),
                    401, code="invalid_api_key")
        check_error(client.post(CHAT, json=chat(), headers={"Authorization": "Basic sk-one"}),
                    401, code="invalid_api_key")
        check_error(client.get("/v1/models"), 401)
        good = {"Authorization": "Bearer sk-one"}
        assert client.post(CHAT, json=chat(), headers=good).status_code == 200
        assert client.get("/v1/models", headers=good).status_code == 200
        # Liveness and metrics stay open.
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200


def test_keys_from_environment(spawn_gateway) -> None:
    gw = spawn_gateway(env={"MINISGL_GATEWAY_API_KEYS": "k1,k2"})
    with httpx.Client(base_url=gw.http_url, timeout=60) as client:
        check_error(client.get("/v1/models"), 401)
        assert client.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200


def test_concurrency_limit_gives_429_with_retry_after(spawn_gateway) -> None:
    gw = spawn_gateway("--max-concurrent-requests", "1", "--retry-after", "3")
    opened = threading.Event()
    release = threading.Event()

    card = httpx.get(gw.http_url + "/v1/models", timeout=30).json()["data"][0]
    budget = card["max_model_len"] - 64  # long enough to still run during the check

    def hold() -> None:
        body = comp(max_tokens=budget, ignore_eos=True, stream=True)
        with httpx.stream("POST", gw.http_url + COMP, json=body, timeout=60) as reply:
            for _ in reply.iter_lines():
                opened.set()
                if release.is_set():
                    break

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert opened.wait(60)
        reply = httpx.post(gw.http_url + COMP, json=comp(), timeout=60)
        check_error(reply, 429)
        assert reply.headers["retry-after"] == "3"
    finally:
        release.set()
        thread.join(60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the slot frees once the stream is gone
        if httpx.post(gw.http_url + COMP, json=comp(), timeout=60).status_code == 200:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the concurrency slot was not released")


def test_body_limit_is_configurable(spawn_gateway) -> None:
    gw = spawn_gateway("--max-body-bytes", "1000", "--max-stop", "2", "--max-n", "2")
    with httpx.Client(base_url=gw.http_url, timeout=60) as client:
        check_error(client.post(COMP, json=comp(prompt="x" * 2000)), 413)
        check_error(client.post(COMP, json=comp(stop=["a", "b", "c"])), 400, param="stop")
        check_error(client.post(COMP, json=comp(n=3)), 400, param="n")
        # Chunked upload without Content-Length is limited too.
        chunks = iter([b'{"prompt": "', b"y" * 3000, b'"}'])
        check_error(client.post(COMP, content=chunks), 413)
        assert client.post(COMP, json=comp(n=2)).status_code == 200
