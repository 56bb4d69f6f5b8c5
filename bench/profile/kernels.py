"""GPU kernel time by kind, from a torch profiler run: the same buckets for minisgl and the peer.

`bench.profile.steps` (ours) and `bench.peer.profile` (vLLM) both end with `by_kind(events)`, so
the two engines' time on the same workload can be read side by side: attention, GEMMs, norms,
activations, the attention prologue (rotary, KV store), all-reduce, sampling, the rest.

A kernel's kind is the first rule whose pattern its name matches (case-insensitive), so the order
of RULES matters: a fused all-reduce + RMSNorm kernel counts as all-reduce, our q/k-norm + rotary +
store prologue as prologue, a torch.compile'd Triton kernel by the ops in its name (vLLM fuses
norms into `triton_red_fused_..._rsqrt_...`). Unmatched kernels count as "other"; the top-kernel
table printed beside the buckets shows what they are.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

RULES: tuple[tuple[str, str], ...] = (
    ("all_reduce", r"all_?reduce|allreduce|nccl|cross_device|one_shot|two_shot"),
    ("moe", r"moe|gate_up_kernel|down_kernel|align_single|count_kernel|place_kernel|"
            r"plan_kernel|topk_softmax|expert|route_topk|sum_over_k"),
    ("prologue", r"rope|rotary|reshape_and_cache|store_kv|qk_norm|concat_and_cache"),
    ("attention", r"attn|attention|flash|fmha|decode_split|decode_merge|merge_(attn_)?states|"
                  r"extend_kernel|paged|batchprefill|batchdecode"),
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|matmul|cublas|splitkreduce|_mm_|scaled_mm"),
    ("norm", r"norm|rsqrt"),
    ("activation", r"silu|gelu|act_and_mul|swiglu"),
    ("quantize", r"quant|fp8"),
    ("sampling", r"sampl|gumbel|argmax|softmax|exponential|top_?k|top_?p|penalt|logits"),
    ("memory", r"memcpy|memset|copy|fill|cat_|index|gather|scatter|embedding"),
)
_COMPILED = tuple((kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in RULES)
KINDS = (*(kind for kind, _ in RULES), "other")


def kind_of(name: str) -> str:
    for kind, pattern in _COMPILED:
        if pattern.search(name):
            return kind
    return "other"


def profiled(run: Callable[[], object], cuda_only: bool, trace: str | None = None,
             raw: list[Any] | None = None) -> tuple[Any, float]:
    """`run()` under the torch profiler: (its `key_averages()`, wall seconds to the GPU's end).
    CPU and CUDA activity, or CUDA only (`cuda_only`: a long run, the host events would cost
    more than they tell); CPU only on a machine without CUDA. `trace`: a chrome trace file.
    `raw`: extended with the run's kineto events (timed activities, for bench.profile.gaps)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CUDA] if cuda_only else [ProfilerActivity.CPU,
                                                            ProfilerActivity.CUDA]
    if not on_gpu:
        activities = [ProfilerActivity.CPU]
    if on_gpu:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        if on_gpu:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if trace:
        prof.export_chrome_trace(trace)
    if raw is not None and prof.profiler is not None and prof.profiler.kineto_results:
        raw.extend(prof.profiler.kineto_results.events())
    return prof.key_averages(), wall


def kernel_times(events: Iterable[Any]) -> dict[str, float]:
    """Kernel name -> seconds of device time, from `prof.key_averages()`: device-side events only
    (an op that launches a kernel also reports the kernel's time as its own self device time;
    counting both would count it twice)."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    out: dict[str, float] = defaultdict(float)
    for e in events:
        if e.device_type == cuda and e.self_device_time_total > 0:
            out[e.key] += e.self_device_time_total / 1e6
    return dict(out)


def by_kind(times: dict[str, float]) -> dict[str, float]:
    """Kernel seconds summed by kind (every kind present, 0 when none ran), rounded to 1 ms."""
    out = dict.fromkeys(KINDS, 0.0)
    for name, seconds in times.items():
        out[kind_of(name)] += seconds
    return {kind: round(seconds, 3) for kind, seconds in out.items()}


def top_kernels(times: dict[str, float], rows: int) -> list[tuple[str, str, float]]:
    """The `rows` longest kernels: (kind, name cut to 90 characters, seconds)."""
    ranked = sorted(times.items(), key=lambda item: -item[1])[:rows]
    return [(kind_of(name), name[:90], round(seconds, 4)) for name, seconds in ranked]


def report(times: dict[str, float], wall_s: float, rows: int) -> dict[str, Any]:
    """The fields both profile modules print: busy and idle, seconds by kind, top kernels."""
    busy = sum(times.values())
    return {"wall_s": round(wall_s, 3), "gpu_busy_s": round(busy, 3),
            "gpu_idle_pct": round(100 * (1 - busy / wall_s), 1) if wall_s > 0 else None,
            "by_kind_s": by_kind(times), "top_kernels": top_kernels(times, rows)}


__all__ = ["KINDS", "RULES", "by_kind", "kernel_times", "kind_of", "profiled", "report",
           "top_kernels"]
