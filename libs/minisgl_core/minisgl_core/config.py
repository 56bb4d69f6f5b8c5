"""Command-line flags that every service shares, each with an environment variable fallback.

A flag `--port` of the service `scheduler` reads `MINISGL_SCHEDULER_PORT` when not given; flags common
to all services (`--log-level`) read `MINISGL_LOG_LEVEL`. Flags always win over the environment.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from typing import Any

from minisgl_core import logging as core_logging
from minisgl_core.metrics_compat import MODES as COMPAT_MODES
from minisgl_core.metrics_compat import set_compat

# Default loopback ports of the local stack (`minisgl serve`); each service's --port overrides.
DEFAULT_PORTS = {
    "gateway_http": 8000,
    "gateway_grpc": 50051,
    "tokenizer": 50061,
    "detokenizer": 50062,
    "scheduler": 50063,
    "worker": 50064,
}
# The scheduler's prompt tokens a step (--max-prefill-tokens); the worker sizes its TP
# all-reduce buffer for a step of this many plus a full decode batch.
DEFAULT_MAX_PREFILL_TOKENS = 8192
# The in-process `LLM`'s default instead: offline runs want throughput, not the inter-token
# latency of streams that wait while a chunk prefills (vLLM's defaults differ the same way).
# One H100, offline workload: Qwen3-0.6B +1.1 %, Qwen3-8B +1.5 % over 8,192 (docs/benchmarks.md).
OFFLINE_MAX_PREFILL_TOKENS = 16384
DEFAULT_METRICS_PORTS = {
    "tokenizer": 9161,
    "detokenizer": 9162,
    "scheduler": 9163,
    "worker": 9164,
}


def version() -> str:
    """The installed minisgl version (every package of the repository shares it)."""
    try:
        return importlib.metadata.version("minisgl-core")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def flag_value(args: list[str], flag: str) -> str | None:
    """The value an argv list gives `flag` as the service's argparse ends with it: the last
    `--flag V` or `--flag=V`; None if absent."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def env_name(service: str, flag: str) -> str:
    return f"MINISGL_{service}_{flag}".upper().replace("-", "_")


def env_default(service: str, flag: str, default: Any, kind: type = str) -> Any:
    value = os.environ.get(env_name(service, flag))
    if value is None:
        return default
    if kind is bool:
        return value.strip().lower() in ("1", "true", "yes", "on")
    return kind(value)


class ServiceArgs:
    """Builds a parser whose flags fall back to `MINISGL_<SERVICE>_<FLAG>` env vars."""

    def __init__(self, service: str, description: str) -> None:
        self.service = service
        self.parser = argparse.ArgumentParser(
            prog=f"minisgl-{service}",
            description=description,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
            epilog=f"Every flag --x-y may also be set as MINISGL_{service.upper()}_X_Y.",
        )
        self.parser.add_argument(
            "--metrics-compat", default=os.environ.get("MINISGL_METRICS_COMPAT", "off"),
            choices=list(COMPAT_MODES), help="also export metrics under another server's names "
            "('vllm': vllm:* for vLLM's dashboards and routers; env MINISGL_METRICS_COMPAT)")
        self.parser.add_argument("--version", action="version",
                                 version=f"minisgl-{service} {version()}")
        self.parser.add_argument(
            "--log-format", default=os.environ.get("MINISGL_LOG_FORMAT", "auto"),
            choices=core_logging.LOG_FORMATS,
            help="text or json lines; auto: text on a terminal, json otherwise "
            "(env MINISGL_LOG_FORMAT)")

    def add(self, flag: str, default: Any, help: str, kind: type = str, **kw: Any) -> None:
        name = flag.lstrip("-")
        value = env_default(self.service, name, default, kind)
        if kind is bool:
            self.parser.add_argument(
                flag, default=value, action=argparse.BooleanOptionalAction, help=help
            )
        else:
            self.parser.add_argument(flag, default=value, type=kind, help=help, **kw)

    def add_common(self, port: int, metrics_port: int | None = None) -> None:
        self.add("--host", "127.0.0.1", "address to listen on")
        self.add("--port", port, "gRPC port", int)
        if metrics_port is not None:
            self.add("--metrics-port", metrics_port, "Prometheus /metrics port (0: off)", int)
            self.add("--metrics-host", "", "address of the /metrics listener ('': as --host)")
        self.add_internal_security()
        self.add("--log-level", os.environ.get("MINISGL_LOG_LEVEL", "info"), "log level",
                 choices=["debug", "info", "warning", "error"])
        self.add("--drain-timeout", 30.0, "seconds to finish in-flight work on SIGTERM", float)

    def add_internal_security(self) -> None:
        """--internal-token-file / --internal-tls-dir (minisgl_core.security); their env fallbacks
        are the same for every service, so one setting covers a whole deployment."""
        self.parser.add_argument(
            "--internal-token-file", default=os.environ.get("MINISGL_INTERNAL_TOKEN_FILE", ""),
            metavar="PATH", help="file holding the shared token every internal RPC carries "
            "(env MINISGL_INTERNAL_TOKEN_FILE; '': no token)")
        self.parser.add_argument(
            "--internal-tls-dir", default=os.environ.get("MINISGL_INTERNAL_TLS_DIR", ""),
            metavar="DIR", help="mTLS between services: DIR holds ca.crt, tls.crt, tls.key "
            "(env MINISGL_INTERNAL_TLS_DIR; '': plaintext)")

    def parse(self, argv: list[str] | None = None) -> argparse.Namespace:
        ns = self.parser.parse_args(argv)
        set_compat(ns.metrics_compat)  # process-wide, like the metrics registry it extends
        # setup_logging reads it from there, so each service's main needs no change for it.
        core_logging.default_format = ns.log_format
        return ns
