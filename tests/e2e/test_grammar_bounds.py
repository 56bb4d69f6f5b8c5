"""A grammar of a few bytes must not stall the engine (issue #55, item 5). Nested counted
repetition used to cost most of a second at its first mask, inside the step that admitted it, so
every stream paused, and ~150 MB of worker memory per distinct grammar. Through the five
services: the gateway refuses it (400 naming the field) by every route, and a scheduler client
that bypasses the gateway gets its request ended at once; an unrelated stream keeps flowing and
the worker's memory stays put."""

from __future__ import annotations

import time
from typing import Any

import grpc
import httpx
import pytest
from minisgl_core.proto.minisgl.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    scheduler_pb2_grpc,
)
from minisgl_core.sampling import GrammarSpec, SamplingParams

from tests.gateway.test_hostile_load import StreamWatch, _rss_kib
from tests.scheduler.helpers import Conn

pytestmark = pytest.mark.e2e
GAP_S = 0.3  # longest pause the unrelated stream may see


def ruinous(n: int) -> str:
    return f"((a{{1000}}){{1000}}){{{n}}}"


def _bodies() -> list[tuple[dict[str, Any], str]]:
    """(chat body, the field a 400 must name): a distinct grammar each, by each route."""
    msgs = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": f"^{ruinous(4)}$"}},
        "required": ["s"]}}}
    return [
        ({"messages": msgs, "regex": ruinous(2)}, "regex"),
        ({"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"s": {
                "type": "string", "pattern": f"^{ruinous(3)}$"}}, "required": ["s"]}}}},
         "response_format"),
        ({"messages": msgs, "tools": [tool], "tool_choice": "required"}, "tool"),
    ]


def test_ruinous_grammars_refused_without_stalling_others(stack: Any) -> None:
    worker = stack.processes["worker"].pid
    idle = _rss_kib(worker)
    with StreamWatch(stack.http_url) as watch:
        start = time.monotonic()
        for body, field in _bodies():
            reply = httpx.post(f"{stack.http_url}/v1/chat/completions",
                               json={"model": "tiny", "max_tokens": 8, **body}, timeout=60)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert "too complex" in error["message"] and field in (error["param"] or ""), error
        with grpc.insecure_channel(stack.grpc_target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(
                max_tokens=8, grammar=common_pb2.Grammar(regex=ruinous(5))))
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(request, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
            assert "sampling.grammar" in info.value.details()
        gap = watch.longest_gap(start, time.monotonic())
    assert gap <= GAP_S, f"an unrelated stream paused {gap:.2f}s"
    assert watch.status == 200
    assert _rss_kib(worker) <= 2 * idle


def test_worker_ends_a_ruinous_grammar_on_its_own(stack: Any) -> None:
    """Past the gateway (a scheduler client): the worker's bounded compile ends the requests."""
    worker = stack.processes["worker"].pid
    idle = _rss_kib(worker)
    with StreamWatch(stack.http_url) as watch, \
            grpc.insecure_channel(stack.target("scheduler")) as channel:
        conn = Conn(scheduler_pb2_grpc.SchedulerStub(channel))
        start = time.monotonic()
        rids = list(range(1, 5))
        conn.send([(rid, [5, 6, 7], SamplingParams(
            temperature=0.0, max_tokens=16, grammar=GrammarSpec("regex", ruinous(10 + rid))))
            for rid in rids])
        conn.read_until(lambda: all(r in conn.final for r in rids), timeout=30)
        gap = watch.longest_gap(start, time.monotonic())
        conn.requests.put(None)
    assert gap <= GAP_S, f"an unrelated stream paused {gap:.2f}s"
    assert _rss_kib(worker) <= 2 * idle
    for rid in rids:
        assert len(conn.tokens[rid]) <= 1, (rid, conn.tokens[rid])  # EOS at once
        assert conn.final[rid].finish_reason == common_pb2.FINISH_REASON_STOP
