"""W4A16 linear: y = x @ W.T with W in quant/w4a16.py's packed layout, dequantized in registers
(Triton; kernels in w4a16_kernels.py). One entry point, `w4a16_linear`, two kernels:

- decode GEMV (a row a program, no tensor cores): memory-bound, so it is built to stream the
  packed weights at HBM speed. Narrow N strips read whole int32 rows (coalesced along N), one
  scale (and zero) row per group per tile, fp32 accumulation, and split-K so that a 4,096-column
  product still has a few programs per SM (splits reduced in-kernel, see w4a16_kernels.py). The
  programs of a strip's rows run side by side: one HBM read, the others from L2.
- GEMM (tl.dot, w4a16_mma.py): the weight tile dequantized in the registers the tensor cores
  read it from, computed transposed (W_tile @ x_tile.T) so that 16-row decode batches fit
  wgmma; x's columns reordered once a call to match the packing (x_permuted); prefill and
  batched decode. (w4a16_kernels.w4_gemm_kernel, 4-17x slower than bf16, is MoE's helper code.)

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
from dataclasses import dataclass

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
    x_permuted: bool = True  # GEMM: reorder x's columns once (else gather them in the kernel)
    # GEMM: two weights a 32-bit register, inline PTX (w4a16_packed.py; bf16/fp16 on CUDA).
    # With BLOCK_M 16 (rows masked) and split-K it is also the decode path, as Marlin's.
    packed_dequant: bool = False


# (max rows, config): first match wins (tests/gpu/test_w4a16.py --sweep prints a replacement
# table). GEMM tiles are BLOCK_N weight
# columns (wgmma's M side: 64 a warpgroup) by BLOCK_M rows (its N side: 8..256). Register use
# from ptxas (sm_90a, bf16): the GEMV 64x128 takes 56; the GEMM 64x128x128 on 4 warps 189.
CONFIGS: list[tuple[int, W4Config]] = [
    # H200 sweeps (tests/gpu/test_w4a16.py --sweep, Qwen3-8B's four projections a layer):
    # M=1 78 us (GEMV, 1.23x the first guess), 16: 154, 64: 202, 256: 450, 1024: 1187,
    # 4096: 4309 us a layer (bf16 cuBLAS: 109, 109, 111, 153, 495, 1945 us)
    (2, W4Config(True, 1, 32, 256, 4, 1, waves=8)),  # stages unused: prefetched by hand
    (16, W4Config(False, 16, 64, 128, 4, 4, waves=2)),
    (256, W4Config(False, 64, 128, 64, 4, 4, waves=1)),
    (1 << 62, W4Config(False, 128, 128, 64, 8, 4)),
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
    _check(x, w)
    m, k = x.shape
    n = w.out_features
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or config_for(m)
    if w.gidx is not None and cfg.gemv:
        cfg = W4Config(False, 16, 64, 128, waves=2)  # per-row groups: the GEMM's path
    if cfg.gemv:
        return _gemv(x, w, cfg, out)
    return _gemm(x, w, cfg, out)


def _gemv(x: torch.Tensor, w: W4Weight, cfg: W4Config, out: torch.Tensor) -> torch.Tensor:
    from . import w4a16_kernels as kern

    m, k = x.shape
    n = w.out_features
    perm = w.perm
    if perm is not None and m > PERM_GATHER_MAX_M:
        x, perm = x.index_select(1, perm.to(torch.int64)), None
    if x.stride(-1) != 1:
        x = x.contiguous()
    tiles_n = _cdiv(n, cfg.block_n)
    splits, k_per_split = split_plan(m * tiles_n, k, cfg, x.device)
    ws = (torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1
          else out)
    cnt = _counters(x.device) if splits > 1 else w.qweight
    zeros = w.zeros if w.zeros is not None else w.scales
    perm_t = perm if perm is not None else w.qweight
    kern.w4_gemv_kernel[(m, tiles_n, splits)](
        x, w.qweight, w.scales, zeros, perm_t, out, ws, cnt, m, n, k, k_per_split, splits,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0),
        G=w.group_size, HAS_ZEROS=w.zeros is not None, HAS_PERM=perm is not None,
        EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0, BLOCK_M=1,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=splits > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(x))
    return out


_x_orders: dict[tuple, torch.Tensor] = {}


def x_order(k: int, block_k: int, perm: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """int64 [cdiv(K, BLOCK_K) * BLOCK_K]: the x column behind each column of x' (see
    w4a16_mma.py): position k0 + t * BLOCK_K // 4 + c holds canonical row k0 + 4c + t, i.e. input
    feature perm[row]; rows past K point at column K (a zero column the caller appends).
    Cached per weight layout: built on the first call (before CUDA-graph capture)."""
    key = (k, block_k, device, None if perm is None else perm.data_ptr())
    idx = _x_orders.get(key)
    if idx is None:
        steps = _cdiv(k, block_k)
        c4 = block_k // 4
        pos = torch.arange(steps * block_k, device=device)
        blk, rem = pos // block_k, pos % block_k
        row = blk * block_k + 4 * (rem % c4) + rem // c4
        feat = row.clamp(max=k - 1)
        if perm is not None:
            feat = perm.to(device=device, dtype=torch.int64)[feat]
        idx = _x_orders[key] = torch.where(row < k, feat, torch.full_like(feat, k))
    return idx


def _gemm(x: torch.Tensor, w: W4Weight, cfg: W4Config, out: torch.Tensor) -> torch.Tensor:
    from .w4a16_mma import w4_mma_kernel

    if cfg.block_k < 64 or cfg.block_k % 64:
        raise ValueError(f"the W4A16 GEMM needs BLOCK_K a multiple of 64, got {cfg.block_k}")
    m, k = x.shape
    n = w.out_features
    perm = w.perm
    if cfg.x_permuted:
        if k % cfg.block_k:
            x = torch.nn.functional.pad(x, (0, 1))
        x, perm = x.index_select(1, x_order(k, cfg.block_k, perm, x.device)), None
    elif perm is not None and m > PERM_GATHER_MAX_M:
        x, perm = x.index_select(1, perm.to(torch.int64)), None
    if x.stride(-1) != 1:
        x = x.contiguous()
    tiles_m, tiles_n = _cdiv(m, cfg.block_m), _cdiv(n, cfg.block_n)
    splits, k_per_split = split_plan(tiles_m * tiles_n, k, cfg, x.device)
    ws = (torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1
          else out)
    cnt = _counters(x.device) if splits > 1 else w.qweight
    zeros = w.zeros if w.zeros is not None else w.scales
    q16 = w.qweight.view(torch.int16)  # [K // 8, 2N]: the kernel reads halfwords
    w4_mma_kernel[(tiles_m * tiles_n, splits)](
        x, q16, w.scales, zeros, perm if perm is not None else w.qweight,
        w.gidx if w.gidx is not None else w.qweight, out, ws, cnt, m, n, k, k_per_split,
        splits, x.stride(0), q16.stride(0), w.scales.stride(0), out.stride(0),
        G=w.group_size, HAS_ZEROS=w.zeros is not None, HAS_PERM=perm is not None,
        HAS_GIDX=w.gidx is not None, X_PERMUTED=cfg.x_permuted, EVEN_K=k % cfg.block_k == 0,
        EVEN_N=n % cfg.block_n == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=splits > 1,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PACKED=cfg.packed_dequant,
        ASM=cfg.packed_dequant and use_asm(x), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl.options(x))
    return out


def use_asm(x: torch.Tensor) -> bool:
    """The packed dequantization's inline PTX: 16-bit activations on an sm_80+ GPU (the
    interpreter runs no PTX; fp32 has no packed form)."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(x.device)[0] >= 8)
