"""W4A16 linear: y = x @ W.T with W in quant/w4a16.py's packed layout, dequantized in registers
(Triton; kernels in w4a16_kernels.py). One entry point, `w4a16_linear`, two kernels:

- decode GEMV (a row a program, no tensor cores): memory-bound, so it is built to stream the
  packed weights at HBM speed. Narrow N strips read whole int32 rows (coalesced along N), one
  scale (and zero) row per group per tile, fp32 accumulation, and split-K so that a 4,096-column
  product still has a few programs per SM (splits reduced in-kernel, see w4a16_kernels.py). The
  programs of a strip's rows run side by side: one HBM read, the others from L2.
- GEMM (tl.dot): each K step dequantizes a [BLOCK_K, BLOCK_N] tile with its group scale applied
  and feeds the tensor cores; prefill and batched decode.

Act-order (perm): the GEMV and small GEMMs gather x's columns inside the kernel (x is tiny);
from PERM_GATHER_MAX_M rows x is permuted once with index_select (a gather per tile element
would read x's rows sector by sector). gidx (act-order rows of a row-parallel shard) takes the
GEMM with a per-row scale gather: correct and slower.

Tile configs come from CONFIGS by M bucket, no autotuning at serve time (a first-call sweep
would stall serving and differ between runs); tests/gpu/test_w4a16.py --sweep re-tunes it.

Not gemlite (PyPI, Triton low-bit kernels): it wants its own bit-packing and autotunes at serve
time, and its GEMV accumulates split-K with output atomics into a cached, periodically zeroed
buffer; we keep one GPTQ-style layout and CUDA-graph-safe, deterministic reductions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from ..quant.w4a16 import W4Weight
from . import pdl


@dataclass(frozen=True)
class W4Config:
    gemv: bool  # the GEMV kernel (a row a program) or the tensor-core GEMM
    block_m: int  # GEMM rows a tile (the GEMV's is 1)
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    waves: float = 0.0  # split K until there are ~waves * SMs programs (0: never split)
    max_split: int = 16
    group_m: int = 8  # GEMM: row tiles run back to back per column tile


# (max rows, config): first match wins. Guesses for an H200 (132 SMs, 4.8 TB/s) pending a sweep
# (tests/gpu/test_w4a16.py --sweep prints a replacement table). Register use from ptxas (sm_90a):
# the GEMV 64x128 takes 56 registers; GEMM 128x128x64 on 8 warps 187; 128x256 spills.
CONFIGS: list[tuple[int, W4Config]] = [
    (2, W4Config(True, 1, 64, 128, 4, 1, waves=4)),  # stages unused: prefetched by hand
    (16, W4Config(False, 16, 64, 128, 4, 4, waves=3)),
    (32, W4Config(False, 32, 64, 128, 4, 4, waves=3)),
    (64, W4Config(False, 64, 64, 128, 4, 4, waves=2)),
    (128, W4Config(False, 64, 128, 64, 4, 4, waves=1)),
    (1 << 62, W4Config(False, 128, 128, 64, 8, 3)),
]
PERM_GATHER_MAX_M = 64
_COUNTERS = 1 << 16  # split-K tile counters a device (self-resetting, see w4a16_kernels.py)


def config_for(m: int) -> W4Config:
    for max_rows, cfg in CONFIGS:
        if m <= max_rows:
            return cfg
    return CONFIGS[-1][1]


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any number gives the same results
    return torch.cuda.get_device_properties(device).multi_processor_count


_counter_bufs: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """A zeroed int32 buffer per device, allocated once (the first call, before any graph
    capture: the engine warms up first); the kernels leave it zeroed."""
    buf = _counter_bufs.get(device)
    if buf is None:
        buf = _counter_bufs[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return buf


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_plan(tiles: int, k: int, cfg: W4Config, device: torch.device) -> tuple[int, int]:
    """(splits, K per split): about cfg.waves * SMs programs, each split a whole number of
    BLOCK_K steps and none empty."""
    steps = _cdiv(k, cfg.block_k)
    want = 1
    if cfg.waves > 0 and tiles <= _COUNTERS:
        want = _cdiv(int(cfg.waves * _sm_count(device)), tiles)
    want = max(1, min(want, cfg.max_split, steps))
    per_split = _cdiv(steps, want)
    return _cdiv(steps, per_split), per_split * cfg.block_k


def _check(x: torch.Tensor, w: W4Weight) -> None:
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not match a W4 weight with K={w.in_features}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"w4a16_linear takes 16-bit (or fp32) activations, got {x.dtype}")
    if w.qweight.dtype != torch.int32 or w.scales.shape[1] != w.out_features:
        raise ValueError(f"bad W4 weight: qweight {w.qweight.dtype} {tuple(w.qweight.shape)}, "
                         f"scales {tuple(w.scales.shape)}")
    if w.in_features % w.group_size and w.gidx is None:
        raise ValueError(f"K={w.in_features} is not a multiple of the group size {w.group_size}")


def w4a16_linear(x: torch.Tensor, w: W4Weight, config: W4Config | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16; fp32 for tests) @ W.T -> [M, N] in x's dtype. CUDA tensors, or CPU
    tensors under TRITON_INTERPRET=1."""
    from . import w4a16_kernels as kern

    _check(x, w)
    m, k = x.shape
    n = w.out_features
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or config_for(m)
    if w.gidx is not None and cfg.gemv:
        cfg = replace(config_for(16), block_m=16)  # per-row groups: the GEMM's gather path
    perm = w.perm
    if perm is not None and m > PERM_GATHER_MAX_M:
        x, perm = x.index_select(1, perm.to(torch.int64)), None
    if x.stride(-1) != 1:
        x = x.contiguous()
    tiles_m = m if cfg.gemv else _cdiv(m, cfg.block_m)
    tiles_n = _cdiv(n, cfg.block_n)
    splits, k_per_split = split_plan(tiles_m * tiles_n, k, cfg, x.device)
    ws = (torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1
          else out)
    cnt = _counters(x.device) if splits > 1 else w.qweight
    zeros = w.zeros if w.zeros is not None else w.scales
    perm_t = perm if perm is not None else w.qweight
    common = dict(G=w.group_size, HAS_ZEROS=w.zeros is not None, HAS_PERM=perm is not None,
                  EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0,
                  BLOCK_M=1 if cfg.gemv else cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, SPLIT_K=splits > 1, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, **pdl.options(x))
    if cfg.gemv:
        kern.w4_gemv_kernel[(m, tiles_n, splits)](
            x, w.qweight, w.scales, zeros, perm_t, out, ws, cnt, m, n, k, k_per_split, splits,
            x.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0), **common)
    else:
        gidx = w.gidx if w.gidx is not None else w.qweight
        kern.w4_gemm_kernel[(tiles_m * tiles_n, splits)](
            x, w.qweight, w.scales, zeros, perm_t, gidx, out, ws, cnt, m, n, k, k_per_split,
            splits,            x.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0),
            HAS_GIDX=w.gidx is not None, GROUP_M=cfg.group_m,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **common)
    return out
