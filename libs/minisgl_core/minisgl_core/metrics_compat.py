"""vLLM compatibility names: `--metrics-compat vllm` also exports our metrics as `vllm:*`.

Why in the services and not as Prometheus recording rules: a recording rule yields one new series
per expression evaluated at the rule interval, so a histogram would come back as rates or
quantiles, never as the raw `vllm:time_to_first_token_seconds_bucket` counters that vLLM's
dashboard and production-stack's router and KEDA recipes query; rules also only help where one
controls the Prometheus (not a managed one, not a router that scrapes /metrics itself).

How: each metric with a vLLM counterpart is declared with `alias(metric, "vllm:name", ...)`. When
compat mode is on, one extra collector renames those families at scrape time. Nothing is
recorded twice: the cost is paid by the scrape (a few hundred extra lines), not per observation.
Each vLLM name is aliased in exactly one service (the one that owns the fact), so sums across
services never count twice.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

MODES = ("off", "vllm")
M = TypeVar("M", bound=MetricWrapperBase)

_aliases: list[tuple[MetricWrapperBase, tuple[str, ...]]] = []
_lock = threading.Lock()
_mode = "off"


def alias(metric: M, *vllm_names: str) -> M:
    """Also export `metric` under each vLLM family name (counters without `_total`)."""
    with _lock:
        _aliases.append((metric, vllm_names))
    return metric


def set_compat(mode: str) -> None:
    """Turn compatibility names on for this process ('vllm') or leave them off ('off')."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"unknown metrics compatibility mode {mode!r} (one of {MODES})")
    with _lock:
        if mode == "vllm" and _mode != "vllm":
            REGISTRY.register(_VllmNames())
        _mode = mode if _mode == "off" else _mode


def compat_mode() -> str:
    return _mode


def renamed(family: Metric, name: str) -> Metric:
    """A copy of `family` called `name`; its samples keep their suffixes (_total, _bucket...)."""
    out = Metric(name, family.documentation, family.type, family.unit)
    old = family.name
    out.samples = [Sample(name + s.name[len(old):], s.labels, s.value, s.timestamp, s.exemplar,
                          s.native_histogram) for s in family.samples]
    return out


class _VllmNames(Collector):
    def collect(self) -> Iterator[Metric]:
        with _lock:
            pairs = list(_aliases)
        for metric, names in pairs:
            for family in metric.collect():
                for name in names:
                    yield renamed(family, name)

    def describe(self) -> Iterable[Metric]:
        return []  # names are only known at scrape time; no registration-time clash check
