"""OpenTelemetry tracing shared by every service: off unless the standard `OTEL_*` variables say so.

On when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set or
`OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`); `OTEL_SDK_DISABLED=true` or
`OTEL_TRACES_EXPORTER=none` keep it off. Everything else is the SDK's own reading of the
environment: `OTEL_TRACES_SAMPLER(_ARG)`, `OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_*`,
`OTEL_RESOURCE_ATTRIBUTES`. `OTEL_SERVICE_NAME` wins over the default `minisgl-<service>`.

When off, `ENABLED` is False and callers skip all tracing work behind that one check; the
`opentelemetry` packages are not even imported (a deployment without them runs untraced).

Internal hops are long-lived streams that carry many requests, so a request's context rides in
its own message field (`traceparent`, a W3C trace-context string) rather than in the stream's
metadata; unary calls (Tokenize) carry it in metadata as usual.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import Span, SpanKind

log = logging.getLogger(__name__)

ENABLED = False  # set once by `setup`; the flag every hot path checks
_PROPAGATOR: Any = None  # TraceContextTextMapPropagator, once on
_TRACER: Any = None  # trace.Tracer, once on
_PROVIDER: Any = None


def wanted(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether the environment asks for traces (see the module doc)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or
                env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup(service: str) -> bool:
    """Install the SDK's tracer provider when the environment asks for it; returns ENABLED."""
    global ENABLED, _TRACER, _PROVIDER, _PROPAGATOR
    if ENABLED or not wanted():
        return ENABLED
    try:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        log.warning("OTEL_* asks for traces but the opentelemetry packages are not installed "
                    "(pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc); "
                    "tracing stays off")
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    attributes = {"minisgl.service": service}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes[SERVICE_NAME] = f"minisgl-{service}"
    provider = TracerProvider(resource=Resource.create(attributes))  # sampler from OTEL_TRACES_*
    kinds = [k.strip() for k in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower().split(",")]
    for kind in kinds:
        exporter: SpanExporter
        if kind == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporter = ConsoleSpanExporter()
        elif kind == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()  # endpoint, headers, TLS from OTEL_EXPORTER_OTLP_*
        else:
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported here (otlp, console)", kind)
            continue
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _PROPAGATOR = TraceContextTextMapPropagator()
    _PROVIDER = provider
    _TRACER = provider.get_tracer("minisgl")
    ENABLED = True
    atexit.register(shutdown)
    log.info("tracing on: OTLP export per OTEL_* (sampler %s)",
             os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on"))
    return True


def shutdown() -> None:
    """Flush and stop the exporters (at exit; the batch processor would lose its last spans)."""
    provider = _PROVIDER
    if provider is not None:
        provider.shutdown()


def tracer() -> trace.Tracer:
    """The tracer once `setup` turned tracing on (call only when ENABLED)."""
    return cast("trace.Tracer", _TRACER)


# -- W3C trace context -------------------------------------------------------------------------

def traceparent_of(span: Span) -> str:
    """The W3C traceparent naming `span`; empty when it is not recording (not sampled)."""
    ctx = span.get_span_context()
    if not ctx.is_valid or not span.is_recording():
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def context_from(traceparent: str) -> otel_context.Context | None:
    """The context whose remote parent `traceparent` names; None for empty or malformed (or
    tracing off)."""
    if not traceparent or not ENABLED:
        return None
    from opentelemetry import trace

    ctx = _PROPAGATOR.extract({"traceparent": traceparent})
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return cast("otel_context.Context", ctx)


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None
                          ) -> otel_context.Context | None:
    """The remote parent a gRPC call's `traceparent` (+ `tracestate`) metadata names."""
    carrier = {k: v for k, v in (metadata or ()) if k in ("traceparent", "tracestate")
               and isinstance(v, str)}
    if "traceparent" not in carrier or not ENABLED:
        return None
    from opentelemetry import trace

    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def inject_metadata(span: Span | None = None) -> list[tuple[str, str]]:
    """gRPC metadata carrying `span` (default: the current span); empty when not traced."""
    if not ENABLED:
        return []
    from opentelemetry import trace

    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    _PROPAGATOR.inject(carrier, context=ctx)
    return list(carrier.items())


def start_span(name: str, parent: str | otel_context.Context | None,
               attributes: dict[str, str | int | float | bool] | None = None,
               kind: SpanKind | None = None, start_time: int | None = None,
               links: Sequence[str] = ()) -> Span:
    """A span under `parent` (a traceparent string or a context); not current, end it yourself.
    `links` are traceparents of related spans (a batch's other requests). Only when ENABLED."""
    from opentelemetry import trace
    from opentelemetry.trace import Link, SpanKind

    ctx = context_from(parent) if isinstance(parent, str) else parent
    link_objs = []
    for tp in links:
        lctx = context_from(tp)
        if lctx is not None:
            link_objs.append(Link(trace.get_current_span(lctx).get_span_context()))
    return cast("Span", _TRACER.start_span(name, context=ctx, kind=kind or SpanKind.INTERNAL,
                                           attributes=attributes, start_time=start_time,
                                           links=link_objs))
