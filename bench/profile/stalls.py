"""Host-side stalls of a run, counted in this process: garbage collections, Triton compiles (or
loads from its cache) and CUDA caching-allocator slow paths.

Why: `bench.profile.gaps` shows where the GPU waited for the host, not why. A gap of tens of ms in
the middle of a step, between two kernels launched back to back by the same Python function, is
one of these: a full collection, a kernel variant first met in the timed run (a new
specialisation of an integer argument), or a cudaMalloc/cudaFree (a free synchronises the device)
after the allocator ran out of cached blocks.
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Allocator counters worth a delta (torch.cuda.memory_stats keys).
_ALLOC_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


@contextmanager
def host_stalls(into: dict[str, Any]) -> Iterator[None]:
    """Fill `into` with what stalled the host while the block ran (see the module's note)."""
    gc_ms: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # count, total, max
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            ms = (time.perf_counter() - started.pop()) * 1e3
            row = gc_ms[info.get("generation", -1)]
            row[0] += 1
            row[1] += ms
            row[2] = max(row[2], ms)

    compiles: list[tuple[str, float]] = []
    jit_cls, original = _triton_jit()
    if jit_cls is not None and original is not None:
        def timed_compile(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                compiles.append((getattr(self, "__name__", "?"),
                                 (time.perf_counter() - t0) * 1e3))

        jit_cls._do_compile = timed_compile
    before = _alloc_stats()
    gc.callbacks.append(on_gc)
    try:
        yield
    finally:
        gc.callbacks.remove(on_gc)
        if jit_cls is not None and original is not None:
            jit_cls._do_compile = original
        after = _alloc_stats()
        into["gc"] = {f"gen{g}": [int(n), round(total, 2), round(top, 2)]
                      for g, (n, total, top) in sorted(gc_ms.items())}
        into["triton_compiles"] = (  # count, total ms, kernels; None: this Triton has no hook
            [len(compiles), round(sum(ms for _, ms in compiles), 1),
             sorted({name for name, _ in compiles})] if original is not None else None)
        into["allocator"] = {k: after.get(k, 0) - before.get(k, 0) for k in _ALLOC_KEYS}


def _triton_jit() -> tuple[Any, Any]:
    """Triton's JITFunction and its compile-on-miss method, where this Triton has one."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None, None
    return JITFunction, getattr(JITFunction, "_do_compile", None)


def _alloc_stats() -> dict[str, int]:
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in _ALLOC_KEYS}


__all__ = ["host_stalls"]
