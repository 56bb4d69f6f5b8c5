"""Scheduler knobs. Every field is also a `python -m minisgl_scheduler` flag (see __main__)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from minisgl_core.config import DEFAULT_MAX_PREFILL_TOKENS

CacheKind = Literal["radix", "naive"]
Policy = Literal["fcfs", "lpm"]


@dataclass
class SchedulerConfig:
    """The `help` metadata of each field is its flag's --help text."""

    max_running_requests: int = field(default=256, metadata={"help": (
        "requests holding a worker slot at once, prefilling or decoding (also capped by the "
        "worker's max_slots)")})
    max_queued_requests: int = field(default=4096, metadata={"help": (
        "waiting requests; beyond this, submits are refused as OVERLOADED")})
    max_prefill_tokens: int = field(default=DEFAULT_MAX_PREFILL_TOKENS, metadata={"help": (
        "prompt tokens computed per step, summed over requests; longer prompts are chunked")})
    cache: CacheKind = field(default="radix", metadata={"help": (
        "prefix cache: radix (shared KV pages) or naive (none)")})
    policy: Policy = field(default="fcfs", metadata={"help": (
        "admission order: fcfs (arrival), or lpm (longest cached prefix first: better hit rate "
        "under load)")})
    disable_overlap: bool = field(default=False, metadata={"help": (
        "collect each step before planning the next (no overlap scheduling: simpler, slower)")})
    # Keeping a share free means new requests rarely force preemptions.
    decode_reserve_ratio: float = field(default=0.25, metadata={"help": (
        "share of running requests' remaining max_tokens kept free in the KV pool on admission "
        "(0: admit greedily and rely on preemption)")})
    # Matching every waiting prompt against the prefix cache costs CPU on a long queue.
    lpm_max_queue: int = field(default=128, metadata={"help": (
        "queue length beyond which lpm falls back to fcfs")})
    default_max_tokens: int = field(default=16, metadata={"help": (
        "max_tokens for requests that leave it 0 (the proto's server default)")})

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
