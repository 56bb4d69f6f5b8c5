"""Prefix-cache hit rate over a load, from an engine's Prometheus counters: minisgl's scheduler
(`minisgl_prefix_cache_{hits,queries}_total`) or vLLM's server (`vllm:prefix_cache_*_total`),
both in prompt tokens; the rate is the change in hits over the change in queries."""

from __future__ import annotations

import urllib.request

NAMES = {"minisgl": ("minisgl_prefix_cache_hits_total", "minisgl_prefix_cache_queries_total"),
         "vllm": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")}


def read(metrics_url: str) -> str:
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        return str(reply.read().decode())


def counters(metrics_url: str, engine: str) -> tuple[float, float]:
    """(hit tokens, queried tokens) summed over label sets; (0, 0) when the names are absent."""
    return counters_in(read(metrics_url), engine)


def counters_in(text: str, engine: str) -> tuple[float, float]:
    """`counters` of a /metrics page already read."""
    hits_name, queries_name = NAMES[engine]
    hits = queries = 0.0
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == hits_name:
            hits += float(line.rsplit(" ", 1)[1])
        elif name == queries_name:
            queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def hit_rate(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    queries = after[1] - before[1]
    return round((after[0] - before[0]) / queries, 4) if queries else None
