"""Prometheus helpers: one exporter per process, metric names prefixed `minisgl_`.

vLLM names its metrics `vllm:...`; our own names avoid the colon, which Prometheus reserves for
recording rules. With `--metrics-compat vllm` every metric that has a vLLM counterpart is also
exported under vLLM's name (`alias` below, `minisgl_core.metrics_compat`), so vLLM's dashboard
and production-stack's router/KEDA recipes work unchanged.

Metrics about serving a model carry a `model_name` label (vLLM's label name). Histogram buckets
are vLLM's, so its panels and ours agree.
"""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge, Histogram

from minisgl_core.metrics_compat import alias as alias  # re-exported: services declare aliases
from minisgl_core.metrics_http import serve_text_metrics

PREFIX = "minisgl_"
MODEL = "model_name"  # the label vLLM's dashboards select on

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)
# vLLM's request phase histograms (queue, prefill, decode, inference) reach two hours.
REQUEST_LATENCY_BUCKETS = (*E2E_BUCKETS, 1920.0, 7680.0)
# vLLM's per-request mean time per output token.
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
PARAMS_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)


def buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return tuple(out)
            out.append(float(v))
        exp += 1


def iteration_buckets(max_tokens: int) -> tuple[float, ...]:
    """Tokens per scheduler iteration: powers of two up to the step's token budget."""
    out = [1.0]
    while out[-1] < max_tokens:
        out.append(out[-1] * 2)
    return tuple(out)


_started: set[int] = set()
_lock = threading.Lock()


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> None:
    """Serve /metrics on `port` once per process (later calls with the same port are no-ops)."""
    with _lock:
        if port in _started:
            return
        serve_text_metrics(port, addr)
        _started.add(port)


def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(PREFIX + name, doc, labels)


def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
    return Gauge(PREFIX + name, doc, labels)


def histogram(name: str, doc: str, buckets: tuple[float, ...],
              labels: tuple[str, ...] = ()) -> Histogram:
    return Histogram(PREFIX + name, doc, labels, buckets=buckets)
