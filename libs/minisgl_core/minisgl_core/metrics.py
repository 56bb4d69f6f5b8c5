"""Prometheus helpers: one exporter per process, metric names prefixed `minisgl_`.

vLLM names its metrics `vllm:...`; we avoid the colon, which Prometheus reserves for recording rules
and which current prometheus_client escapes to `_` when a scraper negotiates OpenMetrics.

Histogram buckets follow vLLM/SGLang so their Grafana panels carry over.
"""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge, Histogram, start_http_server

PREFIX = "minisgl_"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)

_started: set[int] = set()
_lock = threading.Lock()


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> None:
    """Serve /metrics on `port` once per process (later calls with the same port are no-ops)."""
    with _lock:
        if port in _started:
            return
        start_http_server(port, addr=addr)
        _started.add(port)


def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(PREFIX + name, doc, labels)


def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
    return Gauge(PREFIX + name, doc, labels)


def histogram(name: str, doc: str, buckets: tuple[float, ...],
              labels: tuple[str, ...] = ()) -> Histogram:
    return Histogram(PREFIX + name, doc, labels, buckets=buckets)
