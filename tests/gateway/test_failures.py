"""Failures of real services, seen through the gateway: upstreams killed mid-generation and started
again, a scheduler that refuses work, stop strings and hang-ups that must abort upstream, the
submit/abort coalescing of the one Connect stream, SIGTERM drain, TLS.

Tests that kill a service use their own small stack (`small`); the others use the session stack.
Speeds on the tiny CPU model: about 80 tokens/s for one request, so LONG tokens take ~25 s; a
request of LONG tokens that ends within a few seconds was ended by what the test did."""

from __future__ import annotations

import asyncio
import signal
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from minisgl.launcher import Stack, StackConfig
from minisgl_core.ports import free_port
from minisgl_core.proto.minisgl.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    scheduler_pb2,
)
from minisgl_gateway.api.generation import Generation
from minisgl_gateway.api.grpc_schema import generate_job
from minisgl_gateway.api.job import Job
from minisgl_gateway.config import GatewayConfig
from minisgl_gateway.gateway import Gateway
from minisgl_gateway.upstream.pipeline import Pipeline

from .live_stack import (
    LiveStack,
    idle,
    make_self_signed_cert,
    ready_status,
    scheduler_load,
    sse_events,
    wait_for,
)

COMP = "/v1/completions"
PROMPT = "Once upon a time"
LONG = 1900  # tokens; the window is 2048
RETRY_AFTER = "2"  # the small stack's gateway runs with --retry-after 2


def long_body(**extra: object) -> dict:
    return {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, **extra}


def long_grpc_request() -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(
        max_tokens=LONG, ignore_eos=True))


def assert_served(base_url: str) -> None:
    reply = httpx.post(base_url + COMP, timeout=30,
                       json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4


# -- the small stack for destructive tests -------------------------------------------------------

@pytest.fixture(scope="module")
def small_stack(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[LiveStack]:
    log_dir = tmp_path_factory.mktemp("small-stack")
    config = StackConfig(
        model_path=str(tiny_model_path), http_port=free_port(), grpc_port=free_port(),
        internal_ports={"worker": 0, "tokenizer": 0, "detokenizer": 0, "scheduler": 0},
        # A lost engine's streams wait this long for it to come back (migration), then fail.
        extra_args={"gateway": ["--retry-after", RETRY_AFTER, "--migration-wait", "1"]},
        log_dir=log_dir, metrics=False,
        internal_token=False)  # the tests poll the scheduler directly
    live = LiveStack(Stack(config).start(), log_dir)
    try:
        yield live
    finally:
        alive = {n for n, p in live.stack.processes.items() if p.poll() is None}
        codes = live.stop()
        # A clean drain is part of the contract, for restarted services too.
        assert all(codes[n] == 0 for n in alive), codes


@pytest.fixture
def small(small_stack: LiveStack) -> LiveStack:
    """The small stack, every service up (a failed test may have left one dead) and ready."""
    for name, proc in small_stack.stack.processes.items():
        if proc.poll() is not None and name != "gateway":
            small_stack.restart(name)
    wait_for(lambda: ready_status(small_stack.http_url) == 200, 30, "gateway ready")
    return small_stack


@pytest.mark.parametrize("victim", ["scheduler", "detokenizer"])
def test_upstream_killed_mid_generation_ends_requests_then_recovers(small: LiveStack,
                                                                    victim: str) -> None:
    sched = small.target("scheduler")
    with ThreadPoolExecutor(1) as pool, grpc.insecure_channel(small.grpc_target) as channel:
        unary = pool.submit(httpx.post, small.http_url + COMP, json=long_body(), timeout=60)
        call = generation_pb2_grpc.GenerationStub(channel).GenerateStream(long_grpc_request(),
                                                                         timeout=60)
        next(call)  # generating
        with httpx.stream("POST", small.http_url + COMP, json=long_body(stream=True),
                          timeout=60) as reply:
            assert reply.status_code == 200
            events = sse_events(reply)
            assert "choices" in next(events)
            wait_for(lambda: scheduler_load(sched).running_requests == 3, 10, "3 running")
            small.kill(victim)
            killed_at = time.monotonic()
            rest = list(events)
        # Every in-flight request ends with a clear error, whatever its protocol: at once, or
        # for a lost scheduler once no engine took its streams over within --migration-wait.
        errors = [e for e in rest if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and rest[-1] == "[DONE]", rest[-3:]
        assert errors[0]["error"]["code"] == "upstream_unavailable"
        assert victim in errors[0]["error"]["message"]
        failed = unary.result(timeout=10)
        assert failed.status_code == 503 and failed.headers["retry-after"] == RETRY_AFTER
        assert failed.json()["error"]["type"] == "service_unavailable"
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - killed_at < 10, "the requests were not ended at once"
    if victim == "detokenizer":  # their generation upstream was aborted, pages given back
        wait_for(lambda: idle(sched), 5, "scheduler idle after the detokenizer died")
    # Down: /ready says so, new requests get 503 + Retry-After, the process stays alive.
    wait_for(lambda: ready_status(small.http_url) == 503, 10, "/ready 503")
    assert httpx.get(small.http_url + "/health", timeout=5).status_code == 200
    refused = httpx.post(small.http_url + COMP, json={"prompt": PROMPT}, timeout=30)
    assert refused.status_code == 503 and refused.headers["retry-after"] == RETRY_AFTER
    with grpc.insecure_channel(small.grpc_target) as channel, \
            pytest.raises(grpc.RpcError) as info:
        generation_pb2_grpc.GenerationStub(channel).Generate(
            generation_pb2.GenerateRequest(text=PROMPT), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(info.value.trailing_metadata())["retry-after"] == RETRY_AFTER
    # Back on the same port: the gateway reconnects by itself.
    small.restart(victim)
    wait_for(lambda: ready_status(small.http_url) == 200, 30, "/ready 200 after the restart")
    assert_served(small.http_url)


def test_tokenizer_death_fails_new_requests_not_running_ones(small: LiveStack) -> None:
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", small.http_url + COMP, json=body, timeout=60) as reply:
        events = sse_events(reply)
        assert "choices" in next(events)
        small.kill("tokenizer")
        wait_for(lambda: ready_status(small.http_url) == 503, 10, "/ready 503")
        refused = httpx.post(small.http_url + COMP, json={"prompt": PROMPT}, timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"] == RETRY_AFTER
        assert "tokenizer" in refused.json()["error"]["message"]
        rest = list(events)  # tokenized before the tokenizer died: it runs to the end
    assert rest[-1] == "[DONE]" and not any("error" in e for e in rest if isinstance(e, dict))
    assert [c["finish_reason"] for e in rest if isinstance(e, dict)
            for c in e["choices"] if c["finish_reason"]] == ["length"]
    small.restart("tokenizer")
    wait_for(lambda: ready_status(small.http_url) == 200, 30, "/ready 200 after the restart")
    assert_served(small.http_url)


def test_scheduler_refusal_maps_to_429(small: LiveStack) -> None:
    sched = small.target("scheduler")
    small.restart("scheduler", "--max-running-requests", "1", "--max-queued-requests", "1")
    try:
        wait_for(lambda: ready_status(small.http_url) == 200, 30, "/ready 200")
        with grpc.insecure_channel(small.grpc_target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            running = stub.GenerateStream(long_grpc_request(), timeout=60)
            next(running)
            queued = stub.GenerateStream(long_grpc_request(), timeout=60)
            wait_for(lambda: scheduler_load(sched).waiting_requests == 1, 10, "one queued")
            # Full: one running, one queued. The next submit is refused by the scheduler.
            reply = httpx.post(small.http_url + COMP, json=long_body(), timeout=30)
            assert reply.status_code == 429 and reply.headers["retry-after"] == RETRY_AFTER
            assert reply.json()["error"]["code"] == "overloaded"
            streamed = httpx.post(small.http_url + COMP, json=long_body(stream=True), timeout=30)
            assert streamed.status_code == 429  # refused before the first byte: a real status
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(long_grpc_request(), timeout=30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(info.value.trailing_metadata())["retry-after"] == RETRY_AFTER
            load = scheduler_load(sched)  # the refusals did not disturb the admitted two
            assert (load.running_requests, load.waiting_requests) == (1, 1), load
            running.cancel()
            queued.cancel()
        wait_for(lambda: idle(sched), 10, "scheduler idle")
    finally:
        small.restart("scheduler")  # back to the default limits


# -- the session stack: failures that leave it intact --------------------------------------------

def test_stop_string_finishes_choice_and_aborts_upstream(gw_stack: object,
                                                         upstream_targets: dict[str, str]) -> None:
    greedy = common_pb2.SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with grpc.insecure_channel(gw_stack.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        ref = stub.Generate(generation_pb2.GenerateRequest(text=PROMPT, sampling=greedy),
                            timeout=60).choices[0]
        # A stop string the model really produces, found by generating first.
        text = ref.text
        stop = text[len(text) // 3:len(text) // 3 + 5]
        want = text[:text.index(stop)]
        assert stop.strip() and want, f"no usable stop string in {text!r}"
        greedy.max_tokens = LONG
        stopped = stub.Generate(generation_pb2.GenerateRequest(
            text=PROMPT, sampling=greedy, stop=common_pb2.StopConditions(stop=[stop])),
            timeout=60).choices[0]
    assert stopped.finish_reason == common_pb2.FINISH_REASON_STOP
    assert stopped.text == want and stopped.matched_stop == stop
    assert 0 < len(stopped.token_ids) < len(ref.token_ids)
    assert list(stopped.token_ids) == list(ref.token_ids)[:len(stopped.token_ids)]
    wait_for(lambda: idle(upstream_targets["scheduler"]), 2, "aborted upstream")
    reply = httpx.post(gw_stack.http_url + COMP, timeout=60, json=long_body(
        temperature=0, stop=stop)).json()
    choice = reply["choices"][0]
    assert choice["text"] == want and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop
    assert reply["usage"]["completion_tokens"] == len(stopped.token_ids)  # up to the stop
    # Right after the answer nothing runs: LONG tokens would otherwise take ~25 s more.
    wait_for(lambda: idle(upstream_targets["scheduler"]), 2, "aborted upstream")


def test_client_hangup_aborts_within_a_step(gw_stack: object,
                                            upstream_targets: dict[str, str]) -> None:
    sched = upstream_targets["scheduler"]
    with httpx.stream("POST", gw_stack.http_url + COMP, json=long_body(stream=True),
                      timeout=60) as reply:
        events = sse_events(reply)  # held: dropping the generator would close the stream
        assert "choices" in next(events)
        assert scheduler_load(sched).running_requests == 1
    hung_up = time.monotonic()
    wait_for(lambda: idle(sched), 3, "aborted upstream after the hang-up")
    assert time.monotonic() - hung_up < 3


class ConnectSpy(grpc.aio.StreamStreamClientInterceptor):
    """Records each Connect call and each ConnectRequest the gateway writes on it."""

    def __init__(self) -> None:
        self.calls = 0
        self.sent: list[scheduler_pb2.ConnectRequest] = []

    async def intercept_stream_stream(self, continuation: Callable[..., Any],
                                      client_call_details: grpc.aio.ClientCallDetails,
                                      request_iterator: AsyncIterator[Any]) -> Any:
        self.calls += 1

        async def record() -> AsyncIterator[Any]:
            async for message in request_iterator:
                self.sent.append(message)
                yield message

        return await continuation(client_call_details, record())


def test_submits_and_aborts_are_coalesced(upstream_targets: dict[str, str]) -> None:
    """The gateway's own classes in this process, over the real scheduler and detokenizer: the
    wire to the scheduler is observed by a client interceptor."""

    def job(n: int, max_tokens: int) -> Job:
        return generate_job(generation_pb2.GenerateRequest(text=PROMPT, n=n, sampling=(
            common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))))

    async def main() -> None:
        spy = ConnectSpy()
        channels: list[grpc.aio.Channel] = []

        def spied(target: str) -> grpc.aio.Channel:
            channels.append(grpc.aio.insecure_channel(target, interceptors=[spy]))
            return channels[-1]

        gw = Gateway(GatewayConfig(**upstream_targets))
        gw.pipeline = Pipeline(upstream_targets["scheduler"], grpc.aio.insecure_channel(
            upstream_targets["detokenizer"]), channel_for=spied)
        await gw.start()
        try:
            # The 8 choices of one request are queued in one go: one ConnectRequest.
            gen = Generation(gw, job(8, 3))
            await gen.start()
            choices = await gen.collect()
            gen.close()
            assert [c.finish_reason for c in choices] == ["length"] * 8
            assert [len(c.token_ids) for c in choices] == [3] * 8
            assert [len(m.submits) for m in spy.sent] == [8]
            # Concurrent requests share the one stream; none is lost.
            spy.sent.clear()

            async def one() -> list[int]:
                g = Generation(gw, job(1, 2))
                await g.start()
                out = await g.collect()
                g.close()
                return out[0].token_ids

            outs = await asyncio.gather(*(one() for _ in range(24)))
            assert [len(t) for t in outs] == [2] * 24
            assert sum(len(m.submits) for m in spy.sent) == 24
            # Closing a running request of 6 choices aborts all 6 in one ConnectRequest.
            spy.sent.clear()
            gen = Generation(gw, job(6, LONG))
            await gen.start()
            seen: set[int] = set()
            chunks = gen.chunks()
            while len(seen) < 6:  # every choice is generating
                seen |= {c.index for c in await anext(chunks) if c.token_ids}
            await chunks.aclose()
            gen.close()
            for _ in range(100):  # the writer task sends the aborts on its next turn
                if len(spy.sent) > 1:
                    break
                await asyncio.sleep(0.02)
            assert [(len(m.submits), len(m.aborts)) for m in spy.sent] == [(6, 0), (0, 6)]
            assert spy.calls == 1  # one Connect stream for the whole gateway
        finally:
            await gw.close()
            assert len(channels) == 1

    asyncio.run(main())
    wait_for(lambda: idle(upstream_targets["scheduler"]), 3, "the 6 choices aborted upstream")


def test_sigterm_drains_in_flight_then_exits_zero(spawn_gateway,
                                                  upstream_targets: dict[str, str]) -> None:
    gw = spawn_gateway()
    result: dict[str, object] = {}

    def long_request() -> None:
        result["reply"] = httpx.post(gw.http_url + COMP, timeout=60, json={
            "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True})

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_for(lambda: scheduler_load(upstream_targets["scheduler"]).running_requests == 1, 10,
             "the request is generating")
    gw.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: ready_status(gw.http_url) == 503, 10, "/ready 503 while draining")
    assert httpx.get(gw.http_url + "/ready", timeout=5).json()["draining"] is True
    refused = httpx.post(gw.http_url + COMP, json={"prompt": PROMPT}, timeout=5)
    assert refused.status_code == 503
    thread.join(60)
    reply = result["reply"]
    assert isinstance(reply, httpx.Response) and reply.status_code == 200, reply
    assert reply.json()["usage"]["completion_tokens"] == 200
    assert gw.proc.wait(30) == 0


def test_tls_for_http_and_grpc(spawn_gateway, tmp_path: Path) -> None:
    cert, key = make_self_signed_cert(tmp_path)
    gw = spawn_gateway("--tls-cert", str(cert), "--tls-key", str(key))
    url = f"https://127.0.0.1:{gw.http_port}"
    verify = ssl.create_default_context(cafile=str(cert))
    reply = httpx.post(url + COMP, verify=verify, timeout=30,
                       json={"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{gw.http_port}/health", timeout=5)
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with grpc.secure_channel(gw.grpc_target, creds) as channel:
        out = generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(
            text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True)),
            timeout=30)
    assert len(out.choices[0].token_ids) == 2
    with grpc.insecure_channel(gw.grpc_target) as channel, pytest.raises(grpc.RpcError) as info:
        generation_pb2_grpc.GenerationStub(channel).ListModels(
            generation_pb2.ListModelsRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # plaintext is not spoken there
