"""Gateway settings: every field is a `python -m minisgl_gateway` flag with a MINISGL_GATEWAY_* env
fallback (flags win). services/gateway/README.md documents the limits in a table."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from minisgl_core.config import DEFAULT_PORTS, ServiceArgs

from minisgl_gateway.upstream.discovery import DEFAULT_INTERVAL_S
from minisgl_gateway.upstream.routing import DEFAULT_BALANCE_THRESHOLD, DEFAULT_QUEUE_SLACK, POLICIES


@dataclass
class Limits:
    max_concurrent_requests: int = 512  # generation requests in flight (HTTP + gRPC); 429 past it
    max_body_bytes: int = 8 * 1024 * 1024  # HTTP request body; 413 past it
    max_prompt_tokens: int = 0  # 0: the model's context window minus one output token
    max_completion_tokens: int = 0  # largest max_tokens accepted; 0: the context window
    max_n: int = 16  # choices per request (n times the prompts of a batch completion)
    max_prompts: int = 64  # prompts in one /v1/completions batch
    max_stop: int = 16  # stop strings per request
    max_stop_len: int = 256  # characters per stop string
    max_top_logprobs: int = 20
    retry_after_s: int = 1  # the Retry-After header / trailer sent with 429 and 503
    max_header_bytes: int = 64 * 1024  # HTTP request line + headers; 431 past it
    max_headers: int = 100  # HTTP header fields; 431 past it
    header_timeout_s: float = 10.0  # a request head must arrive within this; 408 + close past it


@dataclass
class Routing:
    """Placing requests on engine replicas (routing.py, discovery.py)."""

    policy: str = "cache_aware"  # round_robin | least_load | cache_aware
    balance_threshold: float = DEFAULT_BALANCE_THRESHOLD  # requests; see routing.py
    queue_slack: int = DEFAULT_QUEUE_SLACK  # requests queued at a full engine; < 0: never spill
    sticky_sessions: bool = False  # a session key keeps its engine (rendezvous hashing)
    discovery_interval: float = DEFAULT_INTERVAL_S  # re-resolving dns:/// and file:// targets


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORTS["gateway_http"]
    grpc_port: int = DEFAULT_PORTS["gateway_grpc"]
    tokenizer: str = f"127.0.0.1:{DEFAULT_PORTS['tokenizer']}"
    detokenizer: str = f"127.0.0.1:{DEFAULT_PORTS['detokenizer']}"
    scheduler: str = f"127.0.0.1:{DEFAULT_PORTS['scheduler']}"
    model_name: str = ""  # empty: the tokenizer's model name
    tool_call_parser: str = "auto"  # hermes | llama3 | mistral | auto (by model name)
    reasoning_parser: str = "auto"  # qwen3 | deepseek_r1 | none | auto (by model name)
    api_keys: list[str] = field(default_factory=list)  # empty: no authentication
    tls_cert: str = ""
    tls_key: str = ""
    # Several gateway processes on one host share the HTTP and gRPC ports (SO_REUSEPORT): the
    # kernel spreads connections over them. Off: a second process on the port fails to start.
    reuse_port: bool = False
    log_level: str = "info"
    drain_timeout: float = 30.0  # SIGTERM: seconds in-flight requests may take to finish
    startup_timeout: float = 0.0  # waiting for the upstreams at start-up; 0: as long as it takes
    upstream_timeout: float = 30.0  # unary upstream calls (Tokenize, DecodeTokens)
    internal_token_file: str = ""  # the token sent on every upstream call (minisgl_core.security)
    internal_tls_dir: str = ""  # mTLS to the upstreams: ca.crt, tls.crt, tls.key
    limits: Limits = field(default_factory=Limits)
    routing: Routing = field(default_factory=Routing)


def _parser() -> ServiceArgs:
    args = ServiceArgs("gateway", "minisgl gateway: OpenAI-compatible HTTP (+SSE) and the public "
                       "minisgl.v1.Generation gRPC API in front of tokenizer, scheduler and "
                       "detokenizer.")
    d, lim = GatewayConfig(), Limits()
    args.add("--host", d.host, "address of the HTTP and gRPC listeners")
    args.add("--port", d.port, "OpenAI-compatible HTTP port", int)
    args.add("--grpc-port", d.grpc_port, "public gRPC port (minisgl.v1.Generation)", int)
    args.add("--tokenizer", d.tokenizer, "tokenizer service address; calls go round robin over "
             "every address it resolves to (e.g. dns:///tokenizer:50061 for a headless Service)")
    args.add("--detokenizer", d.detokenizer, "detokenizer service address")
    args.add("--scheduler", d.scheduler, "engine (scheduler) addresses: host:port, a comma-"
             "separated list, dns:///name:port (every address, re-resolved) or file:///path "
             "(a list in a file, re-read)")
    r = Routing()
    args.add("--routing", r.policy, "how sequences are placed on engines", choices=list(POLICIES))
    args.add("--routing-balance-threshold", r.balance_threshold, "cache_aware/sticky: an engine "
             "more loaded than the least loaded by this many requests takes no cache-affine "
             "traffic", float)
    args.add("--routing-queue-slack", r.queue_slack, "cache_aware: a request whose prefix is on "
             "an engine that would queue it behind this many others (its running-request limit "
             "reached) goes to an engine with a free slot instead; -1: never", int)
    args.add("--sticky-sessions", r.sticky_sessions, "route requests with a session key (OpenAI "
             "`user`, header x-session-id) to the same engine while it is not overloaded", bool)
    args.add("--discovery-interval", r.discovery_interval, "seconds between re-resolutions of a "
             "dns:/// or file:// --scheduler", float)
    args.add("--model-name", d.model_name, "served model id (default: the tokenizer's model name)")
    args.add("--tool-call-parser", d.tool_call_parser, "tool-call syntax of the model: hermes "
             "(Qwen2.5/3), llama3, mistral; auto picks by model name",
             choices=["auto", "hermes", "llama3", "mistral"])
    args.add("--reasoning-parser", d.reasoning_parser, "reasoning syntax: qwen3 (<think>..."
             "</think>), deepseek_r1 (only </think> generated), none; auto picks by model name",
             choices=["auto", "qwen3", "deepseek_r1", "none"])
    args.add("--log-level", os.environ.get("MINISGL_LOG_LEVEL", d.log_level), "log level",
             choices=["debug", "info", "warning", "error"])
    args.parser.add_argument(
        "--api-key", action="append", default=None, metavar="KEY",
        help="accepted API key (repeatable; also MINISGL_GATEWAY_API_KEYS=k1,k2). None: no auth.")
    args.add("--tls-cert", d.tls_cert, "PEM certificate: serve HTTPS and gRPC over TLS")
    args.add("--tls-key", d.tls_key, "PEM private key for --tls-cert")
    args.add("--reuse-port", d.reuse_port, "share the HTTP and gRPC ports with other gateway "
             "processes on this host (SO_REUSEPORT; `minisgl serve --gateway-replicas`)", bool)
    args.add("--drain-timeout", d.drain_timeout, "SIGTERM: seconds to finish in-flight requests",
             float)
    args.add("--startup-timeout", d.startup_timeout, "seconds to wait for the upstreams at "
             "start-up, then exit 1 (0: as long as it takes; /ready says 503 meanwhile)", float)
    args.add("--upstream-timeout", d.upstream_timeout, "seconds for unary upstream calls", float)
    args.add_internal_security()
    args.add("--max-concurrent-requests", lim.max_concurrent_requests,
             "generation requests in flight; more get 429 + Retry-After", int)
    args.add("--max-body-bytes", lim.max_body_bytes, "largest HTTP body; larger get 413", int)
    args.add("--max-prompt-tokens", lim.max_prompt_tokens,
             "longest prompt in tokens (0: context window - 1); longer get 400", int)
    args.add("--max-completion-tokens", lim.max_completion_tokens,
             "largest max_tokens (0: context window); larger get 400", int)
    args.add("--max-n", lim.max_n, "most choices per request", int)
    args.add("--max-prompts", lim.max_prompts, "most prompts in one completions batch", int)
    args.add("--max-stop", lim.max_stop, "most stop strings per request", int)
    args.add("--max-stop-len", lim.max_stop_len, "longest stop string (characters)", int)
    args.add("--max-top-logprobs", lim.max_top_logprobs, "most top_logprobs per position", int)
    args.add("--retry-after", lim.retry_after_s, "seconds in Retry-After with 429/503", int)
    args.add("--max-header-bytes", lim.max_header_bytes,
             "largest HTTP request head (request line + headers); larger get 431", int)
    args.add("--max-headers", lim.max_headers, "most HTTP header fields; more get 431", int)
    args.add("--header-timeout", lim.header_timeout_s,
             "seconds a client has to send a request's headers; slower ones get 408", float)
    return args


def parse_config(argv: list[str] | None = None) -> GatewayConfig:
    service_args = _parser()
    ns = service_args.parse(argv)
    keys = ns.api_key
    if keys is None:
        env = os.environ.get("MINISGL_GATEWAY_API_KEYS", "")
        keys = [k.strip() for k in env.split(",") if k.strip()]
    if bool(ns.tls_cert) != bool(ns.tls_key):
        service_args.parser.error("--tls-cert and --tls-key go together")
    for name in ("max_concurrent_requests", "max_body_bytes", "max_n", "max_prompts", "max_stop",
                 "max_stop_len", "retry_after", "max_header_bytes", "max_headers"):
        if getattr(ns, name) < 1:
            service_args.parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= ns.max_top_logprobs <= 1000:
        service_args.parser.error("--max-top-logprobs must be in [0, 1000]")
    limits = Limits(
        max_concurrent_requests=ns.max_concurrent_requests, max_body_bytes=ns.max_body_bytes,
        max_prompt_tokens=max(0, ns.max_prompt_tokens),
        max_completion_tokens=max(0, ns.max_completion_tokens), max_n=ns.max_n,
        max_prompts=ns.max_prompts, max_stop=ns.max_stop, max_stop_len=ns.max_stop_len,
        max_top_logprobs=ns.max_top_logprobs, retry_after_s=ns.retry_after,
        max_header_bytes=ns.max_header_bytes, max_headers=ns.max_headers,
        header_timeout_s=max(0.1, ns.header_timeout),
    )
    return GatewayConfig(
        host=ns.host, port=ns.port, grpc_port=ns.grpc_port, tokenizer=ns.tokenizer,
        detokenizer=ns.detokenizer, scheduler=ns.scheduler, model_name=ns.model_name,
        api_keys=list(keys), tls_cert=ns.tls_cert, tls_key=ns.tls_key, log_level=ns.log_level,
        reuse_port=ns.reuse_port,
        drain_timeout=ns.drain_timeout, startup_timeout=ns.startup_timeout,
        upstream_timeout=ns.upstream_timeout, limits=limits,
        internal_token_file=ns.internal_token_file, internal_tls_dir=ns.internal_tls_dir,
        routing=Routing(policy=ns.routing, balance_threshold=max(0.0, ns.routing_balance_threshold),
                        sticky_sessions=ns.sticky_sessions, queue_slack=ns.routing_queue_slack,
                        discovery_interval=max(0.05, ns.discovery_interval)),
    )


def help_parser() -> argparse.ArgumentParser:
    return _parser().parser
