"""What the real stack cannot do on demand, against scripted upstreams (fake_upstreams.py) and a
real gateway process: broken streams, refusals, batching, stop-string aborts, drain, TLS."""

from __future__ import annotations

import json
import shutil
import signal
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from .conftest import GatewayProcess, start_gateway
from .fake_upstreams import FakeUpstreams

COMP = "/v1/completions"


@pytest.fixture
def fakes() -> Iterator[FakeUpstreams]:
    upstreams = FakeUpstreams(step_s=0.01).start()
    yield upstreams
    upstreams.stop()


@pytest.fixture
def gateway(fakes: FakeUpstreams, tmp_path: Path) -> Iterator[GatewayProcess]:
    gw = start_gateway({n: fakes.target(n) for n in ("tokenizer", "detokenizer", "scheduler")},
                       tmp_path, "--retry-after", "2")
    yield gw
    gw.stop()


def sse_events(reply: httpx.Response) -> Iterator[dict | str]:
    for line in reply.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.mark.parametrize("broken", ["scheduler", "detokenizer"])
def test_broken_upstream_stream_ends_requests_with_error_then_recovers(
        fakes: FakeUpstreams, gateway: GatewayProcess, broken: str) -> None:
    body = {"prompt": "hi", "max_tokens": 200, "stream": True}
    events: list[dict | str] = []
    with httpx.stream("POST", gateway.http_url + COMP, json=body, timeout=30) as reply:
        assert reply.status_code == 200
        for event in sse_events(reply):
            events.append(event)
            if len(events) == 3:
                getattr(fakes, broken).break_now.set()
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "upstream_unavailable", events[-3:]
    assert broken in errors[0]["error"]["message"]
    assert events[-1] == "[DONE]"
    # The gateway reopens the stream: the next request is served.
    ok = None
    for _ in range(100):
        ok = httpx.post(gateway.http_url + COMP, json={"prompt": "hi", "max_tokens": 3},
                        timeout=30)
        if ok.status_code == 200:
            break
        assert ok.status_code == 503 and ok.headers["retry-after"] == "2"
        time.sleep(0.05)
    assert ok is not None and ok.status_code == 200, ok.text
    wait_for(lambda: not fakes.scheduler.running)


def test_unary_request_during_break_gets_503(fakes: FakeUpstreams,
                                              gateway: GatewayProcess) -> None:
    def breaker() -> None:
        time.sleep(0.3)
        fakes.scheduler.break_now.set()

    threading.Thread(target=breaker).start()
    reply = httpx.post(gateway.http_url + COMP, json={"prompt": "hi", "max_tokens": 200},
                       timeout=30)
    assert reply.status_code == 503 and reply.headers["retry-after"] == "2"
    assert reply.json()["error"]["type"] == "service_unavailable"


def test_scheduler_refusal_maps_to_429(gateway: GatewayProcess) -> None:
    reply = httpx.post(gateway.http_url + COMP, json={"prompt": "OVERLOAD", "max_tokens": 3},
                       timeout=30)
    assert reply.status_code == 429 and reply.headers["retry-after"] == "2"
    assert reply.json()["error"]["code"] == "overloaded"
    streamed = httpx.post(gateway.http_url + COMP, timeout=30, json={
        "prompt": "OVERLOAD", "max_tokens": 3, "stream": True})
    assert streamed.status_code == 429  # refused before the first byte: a real status
    with grpc.insecure_channel(gateway.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(generation_pb2.GenerateRequest(text="OVERLOAD"), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(info.value.trailing_metadata())["retry-after"] == "2"


def test_submits_are_coalesced_into_few_messages(fakes: FakeUpstreams,
                                                 gateway: GatewayProcess) -> None:
    fakes.scheduler.submits_per_message.clear()
    barrier = threading.Barrier(24)

    def one() -> None:
        barrier.wait()
        reply = httpx.post(gateway.http_url + COMP, json={"prompt": "x", "max_tokens": 2},
                           timeout=30)
        assert reply.status_code == 200

    threads = [threading.Thread(target=one) for _ in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sizes = [n for n in fakes.scheduler.submits_per_message if n]
    assert sum(sizes) == 24
    assert len(sizes) < 24 and max(sizes) > 1, sizes


def test_stop_string_finishes_choice_and_aborts_upstream(fakes: FakeUpstreams,
                                                         gateway: GatewayProcess) -> None:
    reply = httpx.post(gateway.http_url + COMP, timeout=30, json={
        "prompt": "hi", "max_tokens": 200, "temperature": 0, "stop": "fox"}).json()
    choice = reply["choices"][0]
    assert choice["text"] == "The quick brown " and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "fox"
    assert reply["usage"]["completion_tokens"] == len("The quick brown fox")  # up to the stop
    assert fakes.scheduler.aborts_seen, "the rid was not aborted upstream"
    wait_for(lambda: not fakes.scheduler.running, timeout=2.0)


def test_client_hangup_aborts_within_a_step(fakes: FakeUpstreams,
                                            gateway: GatewayProcess) -> None:
    fakes.scheduler.aborts_seen.clear()
    with httpx.stream("POST", gateway.http_url + COMP, timeout=30, json={
            "prompt": "hi", "max_tokens": 200, "stream": True}) as reply:
        next(sse_events(reply))
    wait_for(lambda: fakes.scheduler.aborts_seen, timeout=2.0)
    wait_for(lambda: not fakes.scheduler.running, timeout=2.0)


def test_sigterm_drains_in_flight_then_exits_zero(fakes: FakeUpstreams,
                                                  gateway: GatewayProcess) -> None:
    result: dict[str, object] = {}

    def long_request() -> None:
        result["reply"] = httpx.post(gateway.http_url + COMP, timeout=30, json={
            "prompt": "hi", "max_tokens": 80})

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_for(lambda: fakes.scheduler.running)
    gateway.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    ready = httpx.get(gateway.http_url + "/ready", timeout=5)
    assert ready.status_code == 503 and ready.json()["draining"] is True
    refused = httpx.post(gateway.http_url + COMP, json={"prompt": "x"}, timeout=5)
    assert refused.status_code == 503
    thread.join(30)
    reply = result["reply"]
    assert isinstance(reply, httpx.Response) and reply.status_code == 200
    assert reply.json()["usage"]["completion_tokens"] == 80
    assert gateway.proc.wait(30) == 0


def test_ready_turns_503_when_an_upstream_dies(fakes: FakeUpstreams,
                                               gateway: GatewayProcess) -> None:
    assert httpx.get(gateway.http_url + "/ready", timeout=5).status_code == 200
    fakes.servers["detokenizer"].stop(0)
    wait_for(lambda: httpx.get(gateway.http_url + "/ready", timeout=5).status_code == 503)
    reply = httpx.post(gateway.http_url + COMP, json={"prompt": "x"}, timeout=30)
    assert reply.status_code == 503 and "retry-after" in reply.headers
    assert httpx.get(gateway.http_url + "/health", timeout=5).status_code == 200


def test_tls_for_http_and_grpc(fakes: FakeUpstreams, tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed; cannot make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    targets = {n: fakes.target(n) for n in ("tokenizer", "detokenizer", "scheduler")}
    gw = start_gateway(targets, tmp_path, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        url = f"https://127.0.0.1:{gw.http_port}"
        verify = ssl.create_default_context(cafile=str(cert))
        reply = httpx.post(url + COMP, json={"prompt": "x", "max_tokens": 2}, verify=verify,
                           timeout=30)
        assert reply.status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{gw.http_port}/health", timeout=5)
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(gw.grpc_target, creds) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            out = stub.Generate(generation_pb2.GenerateRequest(
                text="x", sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=30)
        assert len(out.choices[0].token_ids) == 2
    finally:
        assert gw.stop() == 0
