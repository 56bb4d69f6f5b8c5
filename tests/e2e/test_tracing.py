"""One request, one trace across the five services, exported over real OTLP/gRPC to an in-process
collector; and its x-request-id in every service's log lines about it."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from minisgl.launcher import Stack, StackConfig
from minisgl_core.otlp_sink import OtlpSink, ReceivedSpan
from minisgl_core.ports import free_port
from minisgl_core.proto.minisgl.v1 import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.e2e

SERVICES = ("gateway", "tokenizer", "detokenizer", "scheduler", "worker")


@pytest.fixture(scope="module")
def traced(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Stack, OtlpSink, Path]]:
    logs = tmp_path_factory.mktemp("traced-logs")
    with OtlpSink() as sink:
        config = StackConfig(
            model_path=str(tiny_model_path), http_port=free_port(), grpc_port=free_port(),
            internal_ports={"worker": 0, "tokenizer": 0, "detokenizer": 0, "scheduler": 0},
            log_dir=logs, log_level="debug", log_format="json", internal_token=False,
            env=sink.env())
        stack = Stack(config).start()
        try:
            yield stack, sink, logs
        finally:
            codes = stack.stop()  # exporters flush at exit
            assert all(code == 0 for code in codes.values()), codes


def _client_parent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _complete_trace(trace_id: str) -> Callable[[list[ReceivedSpan]], bool]:
    """Every service's spans arrived, the gateway's (which ends last) included."""
    def done(spans: list[ReceivedSpan]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        names = {s.name for s in mine}
        return {s.service for s in mine} >= {f"minisgl-{n}" for n in SERVICES} and \
            {"decode", "detokenize", "worker_step"} <= names
    return done


def _check_links(spans: list[ReceivedSpan], client_span: str) -> ReceivedSpan:
    """Every span's parent is in the trace or is the client's span; returns the gateway root."""
    ids = {s.span_id for s in spans}
    assert len(ids) == len(spans)
    for s in spans:
        assert s.parent_span_id in ids or s.parent_span_id == client_span, s
    roots = [s for s in spans if s.parent_span_id == client_span]
    assert len(roots) == 1 and roots[0].service == "minisgl-gateway", roots
    return roots[0]


def _logged(logs: Path, service: str, request_id: str) -> list[dict[str, object]]:
    lines = []
    for raw in (logs / f"{service}.log").read_text(errors="replace").splitlines():
        if request_id in raw:
            entry = json.loads(raw)  # every line is JSON (--log-format json)
            lines.append(entry)
    return lines


def test_one_request_one_trace_across_five_services(
        traced: tuple[Stack, OtlpSink, Path]) -> None:
    stack, sink, logs = traced
    trace_id, client_span, traceparent = _client_parent()
    request_id = "trace-test-" + secrets.token_hex(4)
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="none", max_retries=0)
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="The quick brown fox", max_tokens=6, temperature=0,
        extra_headers={"traceparent": traceparent, "x-request-id": request_id})
    assert raw.headers["x-request-id"] == request_id
    assert raw.parse().choices[0].text is not None

    spans = [s for s in sink.wait_for(_complete_trace(trace_id), timeout=60)
             if s.trace_id == trace_id]
    by_service = {s.service for s in spans}
    assert by_service == {f"minisgl-{n}" for n in SERVICES}, sorted((s.service, s.name)
                                                                    for s in spans)
    root = _check_links(spans, client_span)
    assert root.name == "POST /v1/completions"
    assert {"first_byte", "last_byte"} <= set(root.events)
    names = {(s.service, s.name) for s in spans}
    assert {("minisgl-tokenizer", "tokenize"), ("minisgl-scheduler", "queue"),
            ("minisgl-scheduler", "prefill_chunk"), ("minisgl-scheduler", "decode"),
            ("minisgl-worker", "worker_step"),
            ("minisgl-detokenizer", "detokenize")} <= names, names
    decode = next(s for s in spans if s.name == "decode")
    assert decode.attributes["minisgl.decode_steps"] >= 1
    assert decode.attributes["minisgl.request_id"] == request_id
    chunk = next(s for s in spans if s.name == "prefill_chunk")
    assert chunk.attributes["minisgl.batch_size"] >= 1 and "minisgl.step_id" in chunk.attributes
    worker = next(s for s in spans if s.name == "worker_step")
    assert worker.parent_span_id == chunk.span_id  # the worker's step is under its chunk

    for service in SERVICES:
        lines = _logged(logs, service, request_id)
        assert lines, f"{service}: no log line names request {request_id}"
        assert all(e.get("request_id") == request_id for e in lines), lines


def test_grpc_api_takes_traceparent_and_returns_request_id(
        traced: tuple[Stack, OtlpSink, Path]) -> None:
    stack, sink, _ = traced
    trace_id, client_span, traceparent = _client_parent()
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.GenerateStream(
            generation_pb2.GenerateRequest(text="Hello", sampling={"max_tokens": 4}),
            metadata=(("traceparent", traceparent),))
        replies = list(call)
        sent_back = dict(call.initial_metadata())
    assert replies and sent_back["x-request-id"]  # generated: the client sent none
    spans = [s for s in sink.wait_for(_complete_trace(trace_id), timeout=60)
             if s.trace_id == trace_id]
    root = _check_links(spans, client_span)
    assert root.name == "minisgl.v1.Generation/GenerateStream"
    assert root.attributes["minisgl.request_id"] == sent_back["x-request-id"]
    assert {s.service for s in spans} == {f"minisgl-{n}" for n in SERVICES}


def test_http_request_id_generated_when_absent_or_unusable(
        traced: tuple[Stack, OtlpSink, Path]) -> None:
    stack, _, _ = traced
    generated = httpx.get(stack.http_url + "/health").headers["x-request-id"]
    assert len(generated) == 32 and int(generated, 16) >= 0
    replaced = httpx.get(stack.http_url + "/health",
                         headers={"x-request-id": "has space"}).headers["x-request-id"]
    assert replaced != "has space" and len(replaced) == 32
    kept = httpx.get(stack.http_url + "/health", headers={"x-request-id": "abc-123"})
    assert kept.headers["x-request-id"] == "abc-123"
