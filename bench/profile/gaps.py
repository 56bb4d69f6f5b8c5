"""Where the GPU idles inside a profiled run: the gaps between its busy intervals, by neighbours.

`bench.profile.steps --gaps` feeds this the raw device events of its run. All streams of the
process's GPU are merged into busy intervals (an NCCL kernel on its own stream overlapping a
compute kernel is busy time once); every gap between two intervals is charged to the activity that
ended it and the one that started after it, by kind (bench/profile/kernels.py) and by name. The
time before the first activity and after the last (the host's first launch, the final sync) is
reported apart, since no step overlap can hide it. Why: a GPU-time profile gives the idle share
but not where it sits; a gap after a host-side wait looks different from launch-bound gaps
spread over many small kernels.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from bench.profile.kernels import kind_of

# Gap sizes reported apart: launch-latency-sized, a few launches, a host step, a host stall.
BUCKETS_US = (10.0, 100.0, 1000.0)


@dataclass(frozen=True)
class Activity:
    name: str
    start_ns: int
    end_ns: int


def device_activities(raw_events: Iterable[Any], device_index: int = 0) -> list[Activity]:
    """Kernels, copies and memsets of one GPU from kineto events (`prof.events()`' source:
    `prof.profiler.kineto_results.events()`), in start order."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    out = [Activity(e.name(), e.start_ns(), e.end_ns()) for e in raw_events
           if e.device_type() == cuda and e.device_index() == device_index
           and e.end_ns() > e.start_ns()]
    out.sort(key=lambda a: a.start_ns)
    return out


def _bucket(gap_us: float) -> str:
    low = 0.0
    for edge in BUCKETS_US:
        if gap_us < edge:
            return f"{low:g}-{edge:g}us"
        low = edge
    return f">={low:g}us"


def idle_gaps(acts: list[Activity], wall_s: float, rows: int = 15,
              min_gap_us: float = 2.0) -> dict[str, Any]:
    """Idle seconds inside the busy span, by gap size and by the (before, after) neighbours."""
    if not acts:
        return {"span_s": 0.0, "idle_in_span_s": 0.0, "outside_span_s": round(wall_s, 6)}
    by_size: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_kinds: dict[str, float] = defaultdict(float)
    by_names: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    busy_end, last_name = acts[0].end_ns, acts[0].name
    idle_ns = 0
    for a in acts[1:]:
        gap_ns = a.start_ns - busy_end
        if gap_ns > 0:
            idle_ns += gap_ns
            gap_us = gap_ns / 1e3
            if gap_us >= min_gap_us:
                size = by_size[_bucket(gap_us)]
                size[0] += 1
                size[1] += gap_us / 1e6
                by_kinds[f"{kind_of(last_name)} -> {kind_of(a.name)}"] += gap_us / 1e6
                pair = by_names[f"{last_name[:45]} -> {a.name[:45]}"]
                pair[0] += 1
                pair[1] += gap_us / 1e6
        if a.end_ns >= busy_end:
            busy_end, last_name = a.end_ns, a.name
    span_s = (busy_end - acts[0].start_ns) / 1e9
    top_names = sorted(by_names.items(), key=lambda kv: -kv[1][1])[:rows]
    return {
        "span_s": round(span_s, 6),
        "idle_in_span_s": round(idle_ns / 1e9, 6),
        "outside_span_s": round(max(0.0, wall_s - span_s), 6),
        "gaps_by_size": {k: [int(n), round(s, 6)] for k, (n, s) in sorted(by_size.items())},
        "gaps_by_kinds": {k: round(s, 6) for k, s in
                          sorted(by_kinds.items(), key=lambda kv: -kv[1])[:rows]},
        "gaps_by_names": [[k, int(n), round(s, 6)] for k, (n, s) in top_names],
    }


__all__ = ["Activity", "BUCKETS_US", "device_activities", "idle_gaps"]
