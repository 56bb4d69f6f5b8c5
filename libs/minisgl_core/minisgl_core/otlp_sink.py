"""An in-process OTLP/gRPC trace receiver: the tests' collector, and the benchmarks' sink.

    with OtlpSink() as sink:          # listens on 127.0.0.1:<free port>
        env = sink.env()              # OTEL_* for the services: export here, sample everything
        ...
        spans = sink.wait_for(lambda s: len(s) >= 10, timeout=30)

It is the real OTLP `TraceService` (from `opentelemetry-proto`) answering `Export`, so the
services' exporters run exactly as against an OpenTelemetry Collector. `keep=False` counts spans
without keeping them (a benchmark's sink).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    attributes: dict[str, object]
    events: tuple[str, ...]
    links: tuple[str, ...]  # span ids


def _value(v: object) -> object:
    which = v.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(v, which) if which else None


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.spans: list[ReceivedSpan] = []
        self.count = 0
        self.cond = threading.Condition()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        got: list[ReceivedSpan] = []
        n = 0
        for rs in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for ss in rs.scope_spans:
                n += len(ss.spans)
                if not self.keep:
                    continue
                for s in ss.spans:
                    got.append(ReceivedSpan(
                        service=service, name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        events=tuple(e.name for e in s.events),
                        links=tuple(link.span_id.hex() for link in s.links)))
        with self.cond:
            self.spans += got
            self.count += n
            self.cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpSink:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, keep: bool = True) -> None:
        self._receiver = _Receiver(keep)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        # The generated grpc module is unannotated.
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            self._receiver, self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self.endpoint = f"http://{host}:{self.port}"

    def start(self) -> OtlpSink:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> OtlpSink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self, sampler: str = "parentbased_always_on", delay_ms: int = 200) -> dict[str, str]:
        """OTEL_* for the services: export here over plaintext gRPC, this sampler, batches
        flushed every `delay_ms`."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
                "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_TRACES_SAMPLER": sampler, "OTEL_BSP_SCHEDULE_DELAY": str(delay_ms)}

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._receiver.cond:
            return list(self._receiver.spans)

    @property
    def count(self) -> int:
        """Spans received (kept or not)."""
        with self._receiver.cond:
            return self._receiver.count

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0
                 ) -> list[ReceivedSpan]:
        """The spans once `done(spans)` holds, or what arrived by the timeout."""
        deadline = time.monotonic() + timeout
        with self._receiver.cond:
            while not done(self._receiver.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._receiver.cond.wait(left)
            return list(self._receiver.spans)
