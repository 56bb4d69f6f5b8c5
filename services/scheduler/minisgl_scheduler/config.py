"""The scheduler's flags: its knobs (`SchedulerConfig`, which the in-process `LLM` takes too) and
the service's own (`SchedulerServiceFlags`); `FLAGS` lists every section of
`python -m minisgl_scheduler`."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

from minisgl_core.config import (
    DEFAULT_MAX_PREFILL_TOKENS,
    DEFAULT_METRICS_PORTS,
    DEFAULT_PORTS,
)
from minisgl_core.flags import ServerFlags, ServiceFlags, flag

CacheKind = Literal["radix", "naive"]
Policy = Literal["fcfs", "lpm"]


@dataclass
class SchedulerConfig:
    """Each field is a flag; its `help` is the flag's --help text."""

    max_running_requests: int = flag(256, (
        "requests holding a worker slot at once, prefilling or decoding (also capped by the "
        "worker's max_slots)"))
    max_queued_requests: int = flag(4096, (
        "waiting requests; beyond this, submits are refused as OVERLOADED"))
    max_prefill_tokens: int = flag(DEFAULT_MAX_PREFILL_TOKENS, (
        "prompt tokens computed per step, summed over requests; longer prompts are chunked"))
    # A step carrying many prompt tokens pauses every decode stream until it ends (pacing.py).
    max_step_ms: float = flag(-1.0, (
        "latency target of a step in ms: the prompt tokens of the next step are capped at what "
        "the worker's measured step times say fits, so decode streams keep flowing while long "
        "prompts prefill (chunked); 0: off (only --max-prefill-tokens caps them); -1 (auto): "
        "200 on a CPU worker, off on GPUs"))
    cache: CacheKind = flag("radix", (
        "prefix cache: radix (shared KV pages) or naive (none)"))
    policy: Policy = flag("fcfs", (
        "admission order: fcfs (arrival), or lpm (longest cached prefix first: better hit rate "
        "under load)"))
    disable_overlap: bool = flag(False, (
        "collect each step before planning the next (no overlap scheduling: simpler, slower)"))
    # Keeping a share free means new requests rarely force preemptions.
    decode_reserve_ratio: float = flag(0.25, (
        "share of running requests' remaining max_tokens kept free in the KV pool on admission "
        "(0: admit greedily and rely on preemption)"))
    # Matching every waiting prompt against the prefix cache costs CPU on a long queue.
    lpm_max_queue: int = flag(128, (
        "queue length beyond which lpm falls back to fcfs"))
    # Each preemption costs the victim a recompute (mostly from the prefix cache): capped per
    # step so that a burst of urgent requests cannot flush the whole batch at once.
    max_priority_preemptions: int = flag(4, (
        "running requests of a lower priority (a higher `priority` value) preempted per step to "
        "make room for a waiting request of a higher one; they are recomputed later, not failed "
        "(0: priority only orders the queue)"))
    default_max_tokens: int = flag(16, (
        "max_tokens for requests that leave it 0 (the proto's server default)"))

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
        if not math.isfinite(self.max_step_ms):
            raise ValueError("max_step_ms must be a finite number")
        if self.max_priority_preemptions < 0:
            raise ValueError("max_priority_preemptions must be >= 0")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass
class SchedulerServiceFlags:
    """The service's flags that the in-process scheduler has no use for."""

    worker: str = flag(f"127.0.0.1:{DEFAULT_PORTS['worker']}", "the worker's gRPC address")
    worker_timeout: float = flag(0.0, "seconds to wait for the worker at start-up, then exit 1 "
                                 "(0: wait as long as it takes; health says NOT_SERVING meanwhile)")
    step_timeout: float = flag(600.0, "seconds a step may take before the worker counts as failed")


FLAGS = ServiceFlags(
    "scheduler", "minisgl scheduler: continuous batching over a worker",
    (ServerFlags, SchedulerServiceFlags, SchedulerConfig),
    defaults={"port": DEFAULT_PORTS["scheduler"], "metrics_port": DEFAULT_METRICS_PORTS["scheduler"]},
)
