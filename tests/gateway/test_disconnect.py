"""Clients that go away mid-generation: their requests are aborted upstream at once, leaving no
running request and no KV page held (read from the scheduler's GetLoad)."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import httpx
import pytest
from minisgl_core.proto.minisgl.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

pytestmark = pytest.mark.e2e
CLIENTS = 50


def long_budget(gw_stack) -> int:
    card = httpx.get(f"{gw_stack.http_url}/v1/models", timeout=30).json()["data"][0]
    return min(1000, card["max_model_len"] - 64)


def scheduler_load(gw_stack) -> scheduler_pb2.GetLoadResponse:
    with grpc.insecure_channel(gw_stack.target("scheduler")) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).GetLoad(scheduler_pb2.GetLoadRequest(),
                                                                 timeout=10)


def gateway_running(gw_stack) -> float:
    text = httpx.get(f"{gw_stack.http_url}/metrics", timeout=10).text
    match = re.search(r"^minisgl_gateway_running_requests (\S+)$", text, re.M)
    assert match, "gateway_running_requests missing from /metrics"
    return float(match.group(1))


def wait_idle(gw_stack, timeout: float = 30.0) -> scheduler_pb2.GetLoadResponse:
    deadline = time.monotonic() + timeout
    while True:
        load = scheduler_load(gw_stack)
        idle = (load.running_requests == 0 and load.waiting_requests == 0
                and load.used_pages == 0 and gateway_running(gw_stack) == 0)
        if idle or time.monotonic() > deadline:
            return load
        time.sleep(0.1)


async def _hang_up(client: httpx.AsyncClient, body: dict, got_tokens: list[int]) -> None:
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and '"text":"' in line and '"text":""' not in line:
                got_tokens.append(1)
                return  # leaving the block closes the connection mid-stream


def test_fifty_streaming_clients_hang_up(gw_stack) -> None:
    budget = long_budget(gw_stack)
    body = {"prompt": "And God said, Let there be light", "max_tokens": budget,
            "ignore_eos": True, "stream": True, "temperature": 1.0}
    got: list[int] = []

    async def main() -> None:
        limits = httpx.Limits(max_connections=CLIENTS + 10)
        async with httpx.AsyncClient(base_url=gw_stack.http_url, timeout=120,
                                     limits=limits) as client:
            await asyncio.gather(*(_hang_up(client, body, got) for _ in range(CLIENTS)))

    started = time.monotonic()
    asyncio.run(main())
    assert len(got) == CLIENTS, "every client saw output before hanging up"
    load = wait_idle(gw_stack)
    assert load.running_requests == 0 and load.waiting_requests == 0, load
    assert load.used_pages == 0, f"KV pages leaked: {load}"
    assert gateway_running(gw_stack) == 0
    # Had they not been aborted, 50 x `budget` tokens would still be generating.
    assert time.monotonic() - started < 120


def test_grpc_cancel_and_deadline_abort_upstream(gw_stack) -> None:
    budget = long_budget(gw_stack)
    request = generation_pb2.GenerateRequest(
        text="In the beginning", sampling=common_pb2.SamplingParams(
            max_tokens=budget, ignore_eos=True, temperature=1.0))
    with grpc.insecure_channel(gw_stack.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        calls = [stub.GenerateStream(request, timeout=120) for _ in range(10)]
        for call in calls:
            next(call)  # generating
            call.cancel()
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.CANCELLED
        with pytest.raises(grpc.RpcError) as info:
            list(stub.GenerateStream(request, timeout=1.0))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(request, timeout=1.0)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    load = wait_idle(gw_stack)
    assert (load.running_requests, load.waiting_requests, load.used_pages) == (0, 0, 0), load
