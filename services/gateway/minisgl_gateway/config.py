"""Gateway settings: every field is a `python -m minisgl_gateway` flag with a MINISGL_GATEWAY_* env
fallback (flags win), declared once with minisgl_core.flags. services/gateway/README.md documents
the limits in a table."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from minisgl_core.config import DEFAULT_PORTS
from minisgl_core.flags import (
    ServiceFlags,
    flag,
    group,
    internal_tls_dir_flag,
    internal_token_file_flag,
    log_level_flag,
)

from minisgl_gateway.upstream.discovery import DEFAULT_INTERVAL_S
from minisgl_gateway.upstream.routing import DEFAULT_BALANCE_THRESHOLD, DEFAULT_QUEUE_SLACK, POLICIES


@dataclass
class Limits:
    # generation requests in flight (HTTP + gRPC); 429 past it
    max_concurrent_requests: int = flag(
        512, "generation requests in flight; more get 429 + Retry-After")
    max_body_bytes: int = flag(8 * 1024 * 1024, "largest HTTP body; larger get 413")
    max_prompt_tokens: int = flag(
        0, "longest prompt in tokens (0: context window - 1); longer get 400")
    max_completion_tokens: int = flag(
        0, "largest max_tokens (0: context window); larger get 400")
    max_n: int = flag(16, "most choices per request")  # n times the prompts of a batch completion
    max_prompts: int = flag(64, "most prompts in one completions batch")
    max_stop: int = flag(16, "most stop strings per request")
    max_stop_len: int = flag(256, "longest stop string (characters)")
    max_top_logprobs: int = flag(20, "most top_logprobs per position")
    # the Retry-After header / trailer sent with 429 and 503
    retry_after_s: int = flag(1, "seconds in Retry-After with 429/503", option="--retry-after")
    max_header_bytes: int = flag(
        64 * 1024, "largest HTTP request head (request line + headers); larger get 431")
    max_headers: int = flag(100, "most HTTP header fields; more get 431")
    # a request head must arrive within this; 408 + close past it
    header_timeout_s: float = flag(
        10.0, "seconds a client has to send a request's headers; slower ones get 408",
        option="--header-timeout")
    # a request body must arrive within this after its head; 408 + close past it
    body_timeout_s: float = flag(
        30.0, "seconds a client has to send a request's body after its headers; slower ones get "
        "408", option="--body-timeout")
    # connections whose body is still arriving hold a socket outside --max-concurrent-requests
    max_body_readers: int = flag(
        512, "requests whose body is being received at once; more get 429 + Retry-After")


@dataclass
class Routing:
    """Placing requests on engine replicas (routing.py, discovery.py)."""

    policy: str = flag("cache_aware", "how sequences are placed on engines", option="--routing",
                       choices=tuple(POLICIES))
    # requests; see routing.py
    balance_threshold: float = flag(
        DEFAULT_BALANCE_THRESHOLD, "cache_aware/sticky: an engine more loaded than the least "
        "loaded by this many requests takes no cache-affine traffic",
        option="--routing-balance-threshold")
    # requests queued at a full engine; < 0: never spill
    queue_slack: int = flag(
        DEFAULT_QUEUE_SLACK, "cache_aware: a request whose prefix is on an engine that would "
        "queue it behind this many others (its running-request limit reached) goes to an engine "
        "with a free slot instead; -1: never", option="--routing-queue-slack")
    # a session key keeps its engine (rendezvous hashing)
    sticky_sessions: bool = flag(
        False, "route requests with a session key (OpenAI `user`, header x-session-id) to the "
        "same engine while it is not overloaded")
    # mid-stream migration (upstream/migration.py)
    migration_attempts: int = flag(
        2, "times in a row a sequence whose engine is lost after its first tokens moves to "
        "another engine (or the same one once back), continuing its stream, without a new "
        "token in between (a move after progress starts the count over); 0: it fails instead. "
        "Sampled requests without a seed get one from the gateway so that they resume "
        "identically")
    migration_wait: float = flag(
        10.0, "seconds a sequence being migrated waits for an engine to take it before it fails")
    # re-resolving dns:/// and file:// targets
    discovery_interval: float = flag(
        DEFAULT_INTERVAL_S, "seconds between re-resolutions of a dns:/// or file:// --scheduler")


@dataclass
class TenantLimits:
    """Per-API-key quotas and fair sharing (tenancy.py), SLO-aware admission. All off by
    default. A key is its bearer token; requests without one count as one key."""

    key_max_in_flight: int = flag(
        0, "generation requests in flight per API key; more get 429 + Retry-After (0: no limit)")
    # a token bucket: refills continuously, charged prompt + completion tokens when a request ends
    key_tokens_per_minute: int = flag(
        0, "prompt + completion tokens per minute per API key; a key past it gets 429 + "
        "Retry-After until its budget refills (0: no limit)")
    key_fair_share: bool = flag(
        False, "share --max-concurrent-requests fairly among the API keys sending requests: a "
        "key past its share gets 429 while a slot is kept for each key below it, and the "
        "scheduler takes keys' waiting requests in turn")
    # the gateway's estimate: engine queue length over the recent rate of first tokens
    ttft_slo_ms: float = flag(
        0.0, "time-to-first-token target in ms: a request that the engines' queues say would "
        "wait longer gets 503 + Retry-After at once instead of queueing (0: off)")


@dataclass
class GatewayConfig:
    host: str = flag("127.0.0.1", "address of the HTTP and gRPC listeners")
    port: int = flag(DEFAULT_PORTS["gateway_http"], "OpenAI-compatible HTTP port")
    grpc_port: int = flag(DEFAULT_PORTS["gateway_grpc"], "public gRPC port (minisgl.v1.Generation)")
    tokenizer: str = flag(
        f"127.0.0.1:{DEFAULT_PORTS['tokenizer']}", "tokenizer service address; calls go round "
        "robin over every address it resolves to (e.g. dns:///tokenizer:50061 for a headless "
        "Service)")
    detokenizer: str = flag(f"127.0.0.1:{DEFAULT_PORTS['detokenizer']}",
                            "detokenizer service address")
    scheduler: str = flag(
        f"127.0.0.1:{DEFAULT_PORTS['scheduler']}", "engine (scheduler) addresses: host:port, a "
        "comma-separated list, dns:///name:port (every address, re-resolved) or file:///path "
        "(a list in a file, re-read)")
    model_name: str = flag("", "served model id (default: the tokenizer's model name)")
    tool_call_parser: str = flag(
        "auto", "tool-call syntax of the model: hermes (Qwen2.5/3), llama3, mistral; auto picks "
        "by model name", choices=("auto", "hermes", "llama3", "mistral"))
    reasoning_parser: str = flag(
        "auto", "reasoning syntax: qwen3 (<think>...</think>), deepseek_r1 (only </think> "
        "generated), none; auto picks by model name", choices=("auto", "qwen3", "deepseek_r1",
                                                               "none"))
    log_level: str = log_level_flag()
    # Repeatable; the variable holds a comma-separated list. Empty: no authentication.
    api_keys: list[str] = flag(
        default_factory=list, help="accepted API key (repeatable; also "
        "MINISGL_GATEWAY_API_KEYS=k1,k2). None: no auth.", option="--api-key",
        env="MINISGL_GATEWAY_API_KEYS", metavar="KEY")
    # Tenancy: cached_tokens tells a client how much of its prompt was cached, so with a shared
    # cache it also tells how much of another tenant's recent prompt a guess matched.
    cache_salt_per_key: bool = flag(
        False, "give each API key its own prefix-cache namespace: requests of different keys "
        "never reuse each other's cached prompt pages (their cached_tokens reveal nothing)")
    cache_shared_keys: list[str] = flag(
        default_factory=list, help="API key exempt from --cache-salt-per-key: these keys share "
        "one namespace, the unsalted one (repeatable; also MINISGL_GATEWAY_CACHE_SHARED_KEYS="
        "k1,k2)", option="--cache-shared-key", env="MINISGL_GATEWAY_CACHE_SHARED_KEYS",
        metavar="KEY")
    tls_cert: str = flag("", "PEM certificate: serve HTTPS and gRPC over TLS")
    tls_key: str = flag("", "PEM private key for --tls-cert")
    # Several gateway processes on one host share the HTTP and gRPC ports (SO_REUSEPORT): the
    # kernel spreads connections over them. Off: a second process on the port fails to start.
    reuse_port: bool = flag(False, "share the HTTP and gRPC ports with other gateway processes on "
                            "this host (SO_REUSEPORT; `minisgl serve --gateway-replicas`)")
    drain_timeout: float = flag(30.0, "SIGTERM: seconds to finish in-flight requests")
    startup_timeout: float = flag(
        0.0, "seconds to wait for the upstreams at start-up, then exit 1 (0: as long as it "
        "takes; /ready says 503 meanwhile)")
    # unary upstream calls (Tokenize, DecodeTokens)
    upstream_timeout: float = flag(30.0, "seconds for unary upstream calls")
    # the token sent on every upstream call (minisgl_core.security)
    internal_token_file: str = internal_token_file_flag()
    internal_tls_dir: str = internal_tls_dir_flag()  # mTLS to the upstreams
    limits: Limits = group(Limits, "limits")
    routing: Routing = group(Routing, "routing")
    tenancy: TenantLimits = group(TenantLimits, "tenancy")


FLAGS = ServiceFlags(
    "gateway", "minisgl gateway: OpenAI-compatible HTTP (+SSE) and the public minisgl.v1."
    "Generation gRPC API in front of tokenizer, scheduler and detokenizer.", (GatewayConfig,))

# Limits that must be at least 1 (0 would refuse every request).
_AT_LEAST_ONE = ("max_concurrent_requests", "max_body_bytes", "max_n", "max_prompts", "max_stop",
                 "max_stop_len", "retry_after_s", "max_header_bytes", "max_headers",
                "max_body_readers")


def parse_config(argv: list[str] | None = None) -> GatewayConfig:
    config = FLAGS.build(GatewayConfig, FLAGS.parse(argv))

    def error(message: str) -> None:
        help_parser().error(message)  # exits 2 with the usage, as argparse's own errors do

    if bool(config.tls_cert) != bool(config.tls_key):
        error("--tls-cert and --tls-key go together")
    lim, routing = config.limits, config.routing
    for name in _AT_LEAST_ONE:
        if getattr(lim, name) < 1:
            error(f"--{name.removesuffix('_s').replace('_', '-')} must be >= 1")
    if not 0 <= lim.max_top_logprobs <= 1000:
        error("--max-top-logprobs must be in [0, 1000]")
    # Out-of-range values that have an obvious meaning are clamped rather than refused.
    lim.max_prompt_tokens = max(0, lim.max_prompt_tokens)
    lim.max_completion_tokens = max(0, lim.max_completion_tokens)
    lim.header_timeout_s = max(0.1, lim.header_timeout_s)
    lim.body_timeout_s = max(0.1, lim.body_timeout_s)
    tenancy = config.tenancy
    tenancy.key_max_in_flight = max(0, tenancy.key_max_in_flight)
    tenancy.key_tokens_per_minute = max(0, tenancy.key_tokens_per_minute)
    tenancy.ttft_slo_ms = max(0.0, tenancy.ttft_slo_ms) if math.isfinite(tenancy.ttft_slo_ms) \
        else 0.0
    routing.balance_threshold = max(0.0, routing.balance_threshold)
    routing.discovery_interval = max(0.05, routing.discovery_interval)
    return config


def help_parser() -> argparse.ArgumentParser:
    return FLAGS.parser()
