"""The gateway's Prometheus metrics, served on the HTTP port at /metrics.

Names match the shipped Grafana dashboard; the latency buckets are minisgl_core's (vLLM's)."""

from __future__ import annotations

from minisgl_core.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, counter, gauge, histogram

HTTP_REQUESTS = counter("http_requests_total", "HTTP requests by endpoint and status",
                        ("endpoint", "status"))
GRPC_REQUESTS = counter("grpc_requests_total", "public gRPC calls by method and status code",
                        ("method", "code"))
TTFT = histogram("time_to_first_token_seconds", "arrival to first token, per request",
                 TTFT_BUCKETS)
ITL = histogram("inter_token_latency_seconds", "time between output chunks of a choice",
                ITL_BUCKETS)
E2E = histogram("e2e_request_latency_seconds", "arrival to last token, per request",
                E2E_BUCKETS)
RUNNING = gauge("gateway_running_requests", "generation requests in flight at the gateway")
PROMPT_TOKENS = counter("prompt_tokens_total", "prompt tokens of finished requests")
GENERATION_TOKENS = counter("generation_tokens_total", "tokens generated for finished requests")
UPSTREAM_STREAM_LOSSES = counter("gateway_upstream_stream_losses_total",
                              "scheduler/detokenizer streams lost (then reopened)", ("stream",))

# Routing over engine replicas (label `engine`: the scheduler address; `policy`: --routing).
ROUTED = counter("gateway_routed_requests_total", "sequences routed to an engine, by policy and "
                 "by why the engine was chosen (cache, load, round_robin, sticky, retry)",
                 ("engine", "policy", "reason"))
PREDICTED_CACHED = counter("gateway_predicted_cached_tokens_total", "prompt tokens the router "
                           "expected the engine to have cached", ("engine", "policy"))
REPORTED_CACHED = counter("gateway_reported_cached_tokens_total", "prompt tokens the engine "
                          "reported served from its prefix cache", ("engine", "policy"))
RETRIES = counter("gateway_retries_total", "sequences moved to another engine before their first "
                  "token because theirs failed or was draining (label: the engine left)",
                  ("engine",))
ENGINE_UP = gauge("gateway_engine_up", "1 while the engine takes new requests from this gateway "
                  "(stream open, not draining)", ("engine",))
