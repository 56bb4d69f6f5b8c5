"""Prometheus metrics of the scheduler, named like vLLM's (`vllm:` -> `minisgl_`).

Client-facing latency and token totals are the gateway's (`minisgl_time_to_first_token_seconds`,
...); the scheduler's own copies carry a `scheduler_` prefix so dashboards never count twice.
Gauges mirror `SchedulerStats` after every loop iteration; counters advance by the difference since
the last update, so the core stays free of metrics code. Latency histograms are fed from token
events by the server, which knows when each request arrived.
"""

from __future__ import annotations

import threading
from typing import ClassVar

from minisgl_core import metrics as m

from minisgl_scheduler.stats import SchedulerStats


class SchedulerMetrics:
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
        self.running = m.gauge("num_requests_running", "Requests holding a slot on the worker")
        self.waiting = m.gauge("num_requests_waiting", "Requests queued or preempted")
        self.kv_usage = m.gauge("kv_cache_usage_perc", "Share of KV pages held by requests (0-1)")
        self.cached_pages = m.gauge("prefix_cache_pages", "KV pages held only by the prefix cache")
        self.hit_rate = m.gauge("prefix_cache_hit_rate", "Prefix-cache hit tokens / query tokens")
        self.hits = m.counter("prefix_cache_hits", "Tokens served from the prefix cache")
        self.queries = m.counter("prefix_cache_queries", "Tokens looked up in the prefix cache")
        self.preemptions = m.counter("num_preemptions", "Requests preempted for lack of KV pages")
        self.prompt_tokens = m.counter("scheduler_prompt_tokens", "Prompt tokens of accepted requests")
        self.computed_tokens = m.counter("prefill_computed_tokens",
                                         "Prefill tokens computed (cache misses, recomputation)")
        self.generation_tokens = m.counter("scheduler_generation_tokens", "Tokens generated")
        self.finished = m.counter("request_success", "Requests that ended, by finish reason",
                                  ("finished_reason",))
        self.ttft = m.histogram("scheduler_time_to_first_token_seconds", "Time to first token",
                                m.TTFT_BUCKETS)
        self.itl = m.histogram("scheduler_inter_token_latency_seconds", "Time between output tokens",
                               m.ITL_BUCKETS)
        self.e2e = m.histogram("scheduler_e2e_request_latency_seconds", "Request latency in the scheduler",
                               m.E2E_BUCKETS)
        self.step_time = m.histogram("step_duration_seconds", "One scheduler iteration",
                                     m.STEP_BUCKETS)
        self._last: SchedulerStats | None = None

    def update(self, s: SchedulerStats) -> None:
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.kv_usage.set(s.kv_usage)
        self.cached_pages.set(s.cached_pages)
        self.hit_rate.set(s.prefix_hit_rate)
        last = self._last
        if last is not None:  # counters move by deltas; a new scheduler starts from zero
            self.hits.inc(max(0, s.prefix_hit_tokens - last.prefix_hit_tokens))
            self.queries.inc(max(0, s.prefix_query_tokens - last.prefix_query_tokens))
            self.preemptions.inc(max(0, s.preemptions - last.preemptions))
            self.computed_tokens.inc(max(0, s.prefill_tokens - last.prefill_tokens))
        else:
            self.hits.inc(s.prefix_hit_tokens)
            self.queries.inc(s.prefix_query_tokens)
            self.preemptions.inc(s.preemptions)
            self.computed_tokens.inc(s.prefill_tokens)
        self._last = s
