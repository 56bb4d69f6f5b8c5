"""A snapshot of the scheduler's load and counters (GetLoad, metrics, tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minisgl_scheduler.kv import KVManager


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
    worker_down: bool = False  # the worker did not answer the last step or check

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def kv_usage(self) -> float:
        return self.used_pages / self.total_pages if self.total_pages else 0.0

    @classmethod
    def of(cls, running: int, waiting: int, inflight_steps: int, kv: KVManager,
           counters: dict[str, int], worker_down: bool = False) -> SchedulerStats:
        """From the scheduler's queues, its KV manager and its counters."""
        c = counters
        return cls(running=running, waiting=waiting, inflight_steps=inflight_steps,
                   total_pages=kv.num_pages, free_pages=kv.free_pages,
                   cached_pages=kv.cached_pages,
                   used_pages=kv.num_pages - kv.free_pages - kv.cached_pages,
                   prefix_hit_tokens=c["hit"], prefix_query_tokens=c["query"],
                   preemptions=c["preempt"], prefill_tokens=c["prefill"],
                   decode_tokens=c["decode"], steps=c["steps"], finished=c["done"],
                   worker_down=worker_down)
