"""A snapshot of the scheduler's load and counters (GetLoad, metrics, tests)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    running: int  # requests holding a slot
    waiting: int  # queued or preempted
    inflight_steps: int
    total_pages: int
    free_pages: int
    cached_pages: int  # held only by the prefix cache (evictable)
    used_pages: int  # held by requests (their own pages and locked cached prefixes)
    prefix_hit_tokens: int  # tokens served from the prefix cache at admission
    prefix_query_tokens: int  # tokens that needed KV at admission
    preemptions: int
    prefill_tokens: int  # tokens actually computed in prefill chunks
    decode_tokens: int
    steps: int
    finished: int  # requests that ended, any reason

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def kv_usage(self) -> float:
        return self.used_pages / self.total_pages if self.total_pages else 0.0
