"""Cache salts through the five services (issue #55 item 12): a request's `cache_salt` (OpenAI HTTP
and the public gRPC API) and, with --cache-salt-per-key, its API key decide which cached prompt
pages it may reuse, so `cached_tokens` says nothing about other tenants' prompts. Outputs do not
depend on the salt."""

from __future__ import annotations

import random

import grpc
import httpx
import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.e2e

COMPLETIONS = "/v1/completions"


def _prompt() -> list[int]:
    # Fresh token ids per call: no earlier test has this prefix cached.
    rng = random.Random()
    return [rng.randrange(10, 4000) for _ in range(200)]


def _complete(client: httpx.Client, prompt: list[int], salt: str | None = None,
              key: str | None = None) -> tuple[list[int] | str, int]:
    body: dict[str, object] = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = client.post(COMPLETIONS, json=body, headers=headers)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_separates_namespaces_over_http(gw_stack) -> None:
    prompt = _prompt()
    with httpx.Client(base_url=gw_stack.http_url, timeout=60) as client:
        text_a, cached = _complete(client, prompt, "salt-a")
        assert cached == 0
        again, cached = _complete(client, prompt, "salt-a")
        assert cached > 0 and again == text_a
        text_b, cached = _complete(client, prompt, "salt-b")
        assert cached == 0  # salt-a's pages are not salt-b's
        plain, cached = _complete(client, prompt)
        assert cached == 0  # nor the shared (unsalted) namespace's
        assert text_b == plain == text_a  # greedy outputs do not depend on the salt
        # An empty salt would silently mean "shared": refused, as vLLM does.
        r = client.post(COMPLETIONS, json={"prompt": prompt, "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "cache_salt": "salt-c"})
        assert r.status_code == 200, r.text


def test_cache_salt_on_the_grpc_api(gw_stack) -> None:
    prompt = _prompt()
    with grpc.insecure_channel(gw_stack.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        def cached(salt: str) -> int:
            request = generation_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=prompt), cache_salt=salt,
                sampling=common_pb2.SamplingParams(temperature=0, max_tokens=2))
            return stub.Generate(request, timeout=60).usage.cached_tokens

        assert cached("g-a") == 0
        assert cached("g-a") > 0
        assert cached("g-b") == 0


def test_cache_salt_per_key(spawn_gateway) -> None:
    gw = spawn_gateway("--api-key", "sk-one", "--api-key", "sk-two", "--api-key", "sk-ops",
                       "--api-key", "sk-ci", "--cache-salt-per-key", "--cache-shared-key",
                       "sk-ops", "--cache-shared-key", "sk-ci")
    prompt = _prompt()
    with httpx.Client(base_url=gw.http_url, timeout=60) as client:
        text, cached = _complete(client, prompt, key="sk-one")
        assert cached == 0
        again, cached = _complete(client, prompt, key="sk-one")
        assert cached > 0 and again == text
        # Another key has its own namespace, whatever salt its client picks.
        assert _complete(client, prompt, key="sk-two") == (text, 0)
        assert _complete(client, prompt, "s", key="sk-one")[1] == 0
        assert _complete(client, prompt, "s", key="sk-two")[1] == 0
        # Keys on the allow list share the unsalted namespace with each other.
        assert _complete(client, prompt, key="sk-ops") == (text, 0)
        _, cached = _complete(client, prompt, key="sk-ci")
        assert cached > 0
