"""One request through gateway -> tokenizer -> scheduler -> worker -> detokenizer -> gateway."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.e2e

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Who made the heaven?"}],
        "max_tokens": 12, "temperature": 0}


def _model_id(stack) -> str:
    reply = httpx.get(f"{stack.http_url}/v1/models", timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["data"][0]["id"]


def test_chat_non_stream(stack) -> None:
    body = {**CHAT, "model": _model_id(stack)}
    reply = httpx.post(f"{stack.http_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    assert 0 < data["usage"]["completion_tokens"] <= 12
    assert data["usage"]["prompt_tokens"] > 0


def test_chat_stream_matches_non_stream(stack) -> None:
    body = {**CHAT, "model": _model_id(stack)}
    whole = httpx.post(f"{stack.http_url}/v1/chat/completions", json=body, timeout=60).json()
    pieces: list[str] = []
    done = False
    with httpx.stream("POST", f"{stack.http_url}/v1/chat/completions",
                      json={**body, "stream": True}, timeout=60) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            delta = json.loads(payload)["choices"][0]["delta"]
            pieces.append(delta.get("content") or "")
    assert done
    assert len([p for p in pieces if p]) >= 2, "a stream must arrive in several chunks"
    # Greedy decoding: the stream and the whole answer are the same text.
    assert "".join(pieces) == whole["choices"][0]["message"]["content"]


def test_grpc_generate_unary_and_stream(stack) -> None:
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(
            text="In the beginning", sampling=common_pb2.SamplingParams(temperature=0,
                                                                        max_tokens=10))
        unary = stub.Generate(request, timeout=60)
        text = unary.choices[0].text
        assert text and unary.usage.completion_tokens == len(unary.choices[0].token_ids)
        streamed = list(stub.GenerateStream(request, timeout=60))
        assert "".join(c.text for m in streamed for c in m.choices) == text
        assert streamed[-1].choices[0].finish_reason in (common_pb2.FINISH_REASON_STOP,
                                                         common_pb2.FINISH_REASON_LENGTH)


def _metric_total(text: str, name: str) -> float:
    """Sum of every sample of `name` (all label sets) in a Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            rest = line[len(name):]
            if rest[:1] in (" ", "{", ","):  # "," continues a label set `name` opened
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_one_request_moves_every_services_counter(stack) -> None:
    """Proof that a request crossed all five services: each one's own work counter moved."""
    counters = {
        "gateway": (f"{stack.http_url}/metrics", "minisgl_http_requests_total"),
        "tokenizer": (f"http://127.0.0.1:{stack.metrics_ports['tokenizer']}/metrics",
                      "minisgl_tokenizer_items_total"),
        "scheduler": (f"http://127.0.0.1:{stack.metrics_ports['scheduler']}/metrics",
                      "minisgl_scheduler_prompt_tokens_total"),
        "worker": (f"http://127.0.0.1:{stack.metrics_ports['worker']}/metrics",
                   "minisgl_worker_steps_total"),
        "detokenizer": (f"http://127.0.0.1:{stack.metrics_ports['detokenizer']}/metrics",
                        "minisgl_detokenizer_tokens_total"),
    }

    def read() -> dict[str, float]:
        return {svc: _metric_total(httpx.get(url, timeout=10).text, name)
                for svc, (url, name) in counters.items()}

    before = read()
    reply = httpx.post(f"{stack.http_url}/v1/completions",
                       json={"prompt": "And God said", "max_tokens": 6, "temperature": 0},
                       timeout=60)
    assert reply.status_code == 200, reply.text
    after = read()
    unmoved = [svc for svc in counters if not after[svc] > before[svc]]
    assert not unmoved, (unmoved, before, after)


def test_stop_string_finishes_as_stop_in_the_scheduler(stack) -> None:
    """A stop string found by the detokenizer ends the request upstream with reason STOP."""
    body = {"prompt": "In the beginning", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = httpx.post(f"{stack.http_url}/v1/completions", json=body, timeout=60).json()
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    url = f"http://127.0.0.1:{stack.metrics_ports['scheduler']}/metrics"
    name = 'minisgl_request_success_total{finished_reason="stop"'  # then model_name
    before = _metric_total(httpx.get(url, timeout=10).text, name)
    reply = httpx.post(f"{stack.http_url}/v1/completions", json={**body, "stop": [stop]},
                       timeout=60).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == text[:text.index(stop)]
    deadline = time.monotonic() + 10
    while _metric_total(httpx.get(url, timeout=10).text, name) <= before:
        assert time.monotonic() < deadline, "the scheduler did not record a STOP finish"
        time.sleep(0.1)
