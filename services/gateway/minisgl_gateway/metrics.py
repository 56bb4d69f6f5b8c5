"""The gateway's Prometheus metrics, served on the HTTP port at /metrics.

The gateway owns what the client sees: time to first token, inter-token latency, end-to-end
latency and the token totals of each request, labelled by `model_name`, with vLLM aliases for
`--metrics-compat vllm` (`minisgl_core.metrics_compat`). The latency buckets are vLLM's."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from minisgl_core.metrics import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    MODEL,
    PARAMS_N_BUCKETS,
    TTFT_BUCKETS,
    alias,
    counter,
    gauge,
    histogram,
)
from prometheus_client import Counter, Histogram

HTTP_REQUESTS = counter("http_requests_total", "HTTP requests by endpoint and status",
                        ("endpoint", "status"))
GRPC_REQUESTS = counter("grpc_requests_total", "public gRPC calls by method and status code",
                        ("method", "code"))
CLIENT_DISCONNECTS = counter(
    "gateway_client_disconnects_total", "HTTP clients that hung up before their request was "
    "answered, by phase (body: while sending the request body)", ("phase",))
HTTP_REFUSED = counter(
    "gateway_http_refused_total", "HTTP requests the connection layer refused before the app saw "
    "them (or cut off), by reason (body_timeout: 408; body_readers: 429)", ("reason",))
TTFT = alias(histogram("time_to_first_token_seconds", "arrival to first token, per request",
                       TTFT_BUCKETS, (MODEL,)), "vllm:time_to_first_token_seconds")
ITL = alias(histogram("inter_token_latency_seconds", "time between output chunks of a choice",
                      ITL_BUCKETS, (MODEL,)),
            "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
E2E = alias(histogram("e2e_request_latency_seconds", "arrival to last token, per request",
                      E2E_BUCKETS, (MODEL,)), "vllm:e2e_request_latency_seconds")
RUNNING = gauge("gateway_running_requests", "generation requests in flight at the gateway")
PROMPT_TOKENS = alias(counter("prompt_tokens_total", "prompt tokens of finished requests",
                              (MODEL,)), "vllm:prompt_tokens")
GENERATION_TOKENS = alias(counter("generation_tokens_total",
                                  "tokens generated for finished requests", (MODEL,)),
                          "vllm:generation_tokens")
PARAMS_N = alias(histogram("request_params_n", "n (choices per prompt) of each request",
                           PARAMS_N_BUCKETS, (MODEL,)), "vllm:request_params_n")
UPSTREAM_STREAM_LOSSES = counter("gateway_upstream_stream_losses_total",
                              "scheduler/detokenizer streams lost (then reopened)", ("stream",))


@dataclass(frozen=True, slots=True)
class ModelMetrics:
    """The per-request series of one model, labelled once (a request observes them directly)."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    params_n: Histogram


_by_model: dict[str, ModelMetrics] = {}
_lock = threading.Lock()


def for_model(name: str) -> ModelMetrics:
    found = _by_model.get(name)
    if found is None:
        with _lock:
            found = _by_model.setdefault(name, ModelMetrics(
                TTFT.labels(name), ITL.labels(name), E2E.labels(name), PROMPT_TOKENS.labels(name),
                GENERATION_TOKENS.labels(name), PARAMS_N.labels(name)))
    return found
# Routing over engine replicas (label `engine`: the scheduler address; `policy`: --routing).
ROUTED = counter("gateway_routed_requests_total", "sequences routed to an engine, by policy and "
                 "by why the engine was chosen (cache, load, round_robin, sticky, retry, "
                 "migrate)",
                 ("engine", "policy", "reason"))
PREDICTED_CACHED = counter("gateway_predicted_cached_tokens_total", "prompt tokens the router "
                           "expected the engine to have cached", ("engine", "policy"))
REPORTED_CACHED = counter("gateway_reported_cached_tokens_total", "prompt tokens the engine "
                          "reported served from its prefix cache", ("engine", "policy"))
RETRIES = counter("gateway_retries_total", "sequences moved to another engine before their first "
                  "token because theirs failed or was draining (label: the engine left)",
                  ("engine",))
MIGRATIONS = counter("gateway_migrations_total", "sequences with tokens whose engine was lost, by "
                     "outcome (resumed: continued on an engine; failed: no engine took it within "
                     "--migration-wait or --migration-attempts were used up)", ("outcome",))
ENGINE_UP = gauge("gateway_engine_up", "1 while the engine takes new requests from this gateway "
                  "(stream open, not draining, its worker up)", ("engine",))
