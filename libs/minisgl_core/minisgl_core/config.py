"""Defaults the services share (ports, the prefill chunk) and small helpers about flags.

Flags themselves are declared as dataclass fields (minisgl_core.flags): a flag `--port` of the
service `scheduler` reads `MINISGL_SCHEDULER_PORT` when not given; flags always win.
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

# Each service's default --port when started by hand. `minisgl serve` keeps the gateway's two
# (the public ones) but gives the internal services free ports of its own choosing, so a second
# stack on the host never reaches the first one's services (MINISGL_<SERVICE>_PORT pins one).
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
    """What `service` reads for `flag` from MINISGL_<SERVICE>_<FLAG> when not given it."""
    value = os.environ.get(env_name(service, flag))
    if value is None:
        return default
    return parse_bool(value) if kind is bool else kind(value)


def parse_bool(value: str) -> bool:
    """A boolean flag's environment variable: 1, true, yes or on (any case) are true."""
    return value.strip().lower() in ("1", "true", "yes", "on")
