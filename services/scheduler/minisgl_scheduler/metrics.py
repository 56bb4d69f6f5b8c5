"""Prometheus metrics of the scheduler, named like vLLM's (`vllm:` -> `minisgl_`), labelled by model.

Client-facing latency and token totals are the gateway's (`minisgl_time_to_first_token_seconds`,
...); the scheduler's own copies carry a `scheduler_` prefix so dashboards never count twice.
The scheduler owns what only it sees: queue/running gauges, KV usage, prefix cache, the phases of
each request (queue, prefill, decode, inference time), token-length histograms, tokens per
iteration and the cache configuration; those carry vLLM aliases (`minisgl_core.metrics_compat`).

Gauges mirror `SchedulerStats` after every loop iteration; counters advance by the difference since
the last update, so the core stays free of metrics code. Per-request histograms are fed by
`RequestClock` (request_metrics.py) from the serving loop's token events (loop.py).
"""

from __future__ import annotations

import threading
from typing import ClassVar

from minisgl_core import metrics as m
from minisgl_core.metrics import alias
from minisgl_core.step import WorkerInfo
from prometheus_client import Counter, Gauge, Histogram

from minisgl_scheduler.config import SchedulerConfig
from minisgl_scheduler.stats import SchedulerStats

_MODEL = (m.MODEL,)
# Token-count histograms are declared once per process, before the context window is known.
_MAX_LEN_BUCKETS = m.buckets_1_2_5(1_000_000)


class SchedulerMetrics:
    # Series of this scheduler's model, set by `bind` (the model is known once the worker is).
    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    cached_pages: Gauge
    hit_rate: Gauge
    hits: Counter
    queries: Counter
    preemptions: Counter
    prompt_tokens: Counter
    computed_tokens: Counter
    generation_tokens: Counter
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    step_time: Histogram
    queue: Histogram
    prefill: Histogram
    decode: Histogram
    inference: Histogram
    tpot: Histogram
    prompt_len: Histogram
    generation_len: Histogram
    max_tokens: Histogram
    iteration: Histogram

    _instance: ClassVar[SchedulerMetrics | None] = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> SchedulerMetrics:
        """One set per process: prometheus_client refuses to register a name twice."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        g, c, h = m.gauge, m.counter, m.histogram
        self._gauges: dict[str, Gauge] = {
            "running": alias(g("num_requests_running", "Requests holding a slot on the worker",
                               _MODEL), "vllm:num_requests_running"),
            "waiting": alias(g("num_requests_waiting", "Requests queued or preempted", _MODEL),
                             "vllm:num_requests_waiting"),
            "kv_usage": alias(g("kv_cache_usage_perc", "Share of KV pages held by requests (0-1)",
                                _MODEL), "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            "cached_pages": g("prefix_cache_pages", "KV pages held only by the prefix cache",
                              _MODEL),
            # Older vLLM's gauge, still read by routers (production-stack) that predate the counters.
            "hit_rate": alias(g("prefix_cache_hit_rate", "Prefix-cache hit tokens / query tokens",
                                _MODEL), "vllm:gpu_prefix_cache_hit_rate"),
        }
        self._counters: dict[str, Counter] = {
            "hits": alias(c("prefix_cache_hits", "Tokens served from the prefix cache", _MODEL),
                          "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
            "queries": alias(c("prefix_cache_queries", "Tokens looked up in the prefix cache",
                               _MODEL), "vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
            "preemptions": alias(c("num_preemptions", "Requests preempted for lack of KV pages",
                                   _MODEL), "vllm:num_preemptions"),
            "prompt_tokens": c("scheduler_prompt_tokens", "Prompt tokens of accepted requests",
                               _MODEL),
            "computed_tokens": c("prefill_computed_tokens",
                                 "Prefill tokens computed (cache misses, recomputation)", _MODEL),
            "generation_tokens": c("scheduler_generation_tokens", "Tokens generated", _MODEL),
        }
        self._finished = alias(c("request_success", "Requests that ended, by finish reason",
                                 ("finished_reason", m.MODEL)), "vllm:request_success")
        lat = m.REQUEST_LATENCY_BUCKETS
        self._histograms: dict[str, Histogram] = {
            "ttft": h("scheduler_time_to_first_token_seconds", "Time to first token",
                      m.TTFT_BUCKETS, _MODEL),
            "itl": h("scheduler_inter_token_latency_seconds", "Time between output tokens",
                     m.ITL_BUCKETS, _MODEL),
            "e2e": h("scheduler_e2e_request_latency_seconds", "Request latency in the scheduler",
                     m.E2E_BUCKETS, _MODEL),
            "step_time": h("step_duration_seconds", "One scheduler iteration", m.STEP_BUCKETS,
                           _MODEL),
            "queue": alias(h("request_queue_time_seconds", "Arrival to first scheduled",
                             lat, _MODEL), "vllm:request_queue_time_seconds"),
            "prefill": alias(h("request_prefill_time_seconds", "First scheduled to first token",
                               lat, _MODEL), "vllm:request_prefill_time_seconds"),
            "decode": alias(h("request_decode_time_seconds", "First token to last token",
                              lat, _MODEL), "vllm:request_decode_time_seconds"),
            "inference": alias(h("request_inference_time_seconds",
                                 "First scheduled to last token", lat, _MODEL),
                               "vllm:request_inference_time_seconds"),
            "tpot": alias(h("request_time_per_output_token_seconds",
                            "Mean time per output token after the first, per request",
                            m.TPOT_BUCKETS, _MODEL), "vllm:request_time_per_output_token_seconds"),
            "prompt_len": alias(h("request_prompt_tokens", "Prompt tokens per finished request",
                                  _MAX_LEN_BUCKETS, _MODEL), "vllm:request_prompt_tokens"),
            "generation_len": alias(h("request_generation_tokens",
                                      "Generated tokens per finished request", _MAX_LEN_BUCKETS,
                                      _MODEL), "vllm:request_generation_tokens"),
            "max_tokens": alias(h("request_params_max_tokens", "max_tokens of each request "
                                  "(clipped to the context window)", _MAX_LEN_BUCKETS, _MODEL),
                                "vllm:request_params_max_tokens",
                                "vllm:request_max_num_generation_tokens"),
            "iteration": alias(h("iteration_tokens", "Tokens computed per scheduler iteration",
                                 m.iteration_buckets(16384), _MODEL),
                               "vllm:iteration_tokens_total"),
        }
        self._cache_info = alias(
            g("cache_config_info", "KV cache configuration (value 1; the facts are labels)",
              ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching",
               "max_num_seqs", "max_num_batched_tokens", m.MODEL)),
            "vllm:cache_config_info")
        self.model = ""
        self._finished_by: dict[str, Counter] = {}
        self._last: SchedulerStats | None = None

    def bind(self, info: WorkerInfo, config: SchedulerConfig) -> None:
        """Label every series with the worker's model; publish the cache configuration."""
        model = self.model = info.model_name
        for name, gauge in self._gauges.items():
            setattr(self, name, gauge.labels(model))
        for name, counter in self._counters.items():
            setattr(self, name, counter.labels(model))
        for name, hist in self._histograms.items():
            setattr(self, name, hist.labels(model))
        self._finished_by = {}
        if info.num_pages:
            self._cache_info.clear()
            self._cache_info.labels(
                str(info.page_size), str(info.num_pages), info.kv_cache_dtype or "auto",
                str(config.cache == "radix").lower(), str(config.max_running_requests),
                str(config.max_prefill_tokens), model).set(1)

    def finished(self, reason: str) -> Counter:
        child = self._finished_by.get(reason)
        if child is None:
            child = self._finished_by[reason] = self._finished.labels(reason, self.model)
        return child

    def update(self, s: SchedulerStats) -> None:
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.kv_usage.set(s.kv_usage)
        self.cached_pages.set(s.cached_pages)
        self.hit_rate.set(s.prefix_hit_rate)
        last = self._last
        if last is None or s.steps < last.steps:  # first update, or a new core counting from 0
            last = SchedulerStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        self.hits.inc(max(0, s.prefix_hit_tokens - last.prefix_hit_tokens))
        self.queries.inc(max(0, s.prefix_query_tokens - last.prefix_query_tokens))
        self.preemptions.inc(max(0, s.preemptions - last.preemptions))
        computed = max(0, s.prefill_tokens - last.prefill_tokens)
        self.computed_tokens.inc(computed)
        if s.steps > last.steps:  # tokens of the iterations since the last update
            tokens = computed + max(0, s.decode_tokens - last.decode_tokens)
            self.iteration.observe(tokens / (s.steps - last.steps))
        self._last = s
