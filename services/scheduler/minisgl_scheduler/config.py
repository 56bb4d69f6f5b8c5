"""Scheduler knobs. Every field is also a `python -m minisgl_scheduler` flag (see __main__)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

CacheKind = Literal["radix", "naive"]
Policy = Literal["fcfs", "lpm"]


@dataclass
class SchedulerConfig:
    # Requests holding a slot (prefilling or decoding); also capped by the worker's max_slots.
    max_running_requests: int = 256
    # Requests waiting for admission; one more makes `submit` raise Overloaded.
    max_queued_requests: int = 4096
    # Prompt tokens computed per step, summed over requests; longer prompts are chunked.
    max_prefill_tokens: int = 8192
    cache: CacheKind = "radix"
    # fcfs: arrival order. lpm: longest cached prefix first (better hit rate under load).
    policy: Policy = "fcfs"
    # Launch step N+1 only after step N's tokens came back (simpler, slower).
    disable_overlap: bool = False
    # Admission keeps this share of every running request's remaining max_tokens free in the pool,
    # so new requests rarely force preemptions. 0 admits greedily and relies on preemption.
    decode_reserve_ratio: float = 0.25
    # Past this queue length lpm falls back to fcfs: matching every waiting prompt costs CPU.
    lpm_max_queue: int = 128
    # max_tokens used when a request leaves it 0 (the proto's "server default").
    default_max_tokens: int = 16

    def validate(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        if self.cache not in ("radix", "naive"):
            raise ValueError(f"cache must be 'radix' or 'naive', not {self.cache!r}")
        if self.policy not in ("fcfs", "lpm"):
            raise ValueError(f"policy must be 'fcfs' or 'lpm', not {self.policy!r}")
        if not 0.0 <= self.decode_reserve_ratio <= 1.0:
            raise ValueError("decode_reserve_ratio must be in [0, 1]")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
