"""An fp8 GEMM with row-wise scales for decode-sized batches (Triton), used by
layers/fp8_linear.py.

torch._scaled_mm's row-wise kernel reads the weights of a 16-64-row product at ~1.6-1.8 TB/s on
an H100 (tests/gpu/test_fp8.py). Such a product is memory-bound, so this kernel tiles for
bandwidth: narrow BLOCK_N slabs (many programs), long BLOCK_K steps and four pipeline stages, the
weights streamed once for all BLOCK_M activation rows.

Accuracy: Hopper's fp8 tensor cores accumulate with reduced precision inside one instruction
chain, so each BLOCK_K slice is a separate dot whose result is added to an fp32 accumulator
(what DeepSeek-V3 calls promotion every 128 elements); y = acc * sx[m] * sw[n], rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import begin as _pdl_begin

# (max rows, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, ACC_MODE), from a sweep on an
# H100 (tests/gpu/test_fp8.py --sweep, Qwen3-8B shapes; the four projections of a layer): these
# beat torch._scaled_mm up to 64 rows; from 128 rows it ties or wins, so larger batches go there
# (docs/benchmarks/log/2026-11-23-07.md).
CONFIGS: list[tuple[int, int, int, int, int, int, int]] = [
    (16, 16, 32, 256, 4, 4, 0),
    (64, 64, 32, 256, 4, 4, 0),
]


Config = tuple[int, int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, ACC_MODE


def config_for(m: int) -> Config | None:
    for max_rows, *cfg in CONFIGS:
        if m <= max_rows:
            # Every CONFIGS row has six ints after max_rows; tuple() loses the length.
            return tuple(cfg)  # type: ignore[return-value]
    return None


@triton.jit
def _fp8_gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, m, n, k, stride_a, stride_b,
                     stride_c, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ACC_MODE: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    """c[m, n] = (sum_k a[m, k] * b[n, k]) * sa[m] * sb[n]; a, b fp8 row-major, k a multiple
    of BLOCK_K. Programs walk the M tiles of one N tile first, so a weight slab is fetched from
    memory once and re-read from L2 by the other M tiles."""
    _pdl_begin(USE_PDL)
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(m, BLOCK_M)
    pid_m, pid_n = pid % tiles_m, pid // tiles_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_a + ks[None, :]
    b_ptrs = b_ptr + cols[None, :].to(tl.int64) * stride_b + ks[:, None]
    a_mask, b_mask = rows[:, None] < m, cols[None, :] < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, k, BLOCK_K):
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if ACC_MODE == 0:  # promoted to fp32 once per BLOCK_K slice, by hand
            acc += tl.dot(a, b)
        elif ACC_MODE == 1:  # the same promotion, done by the compiler's wgmma pipeline
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:  # never promoted (Hopper's reduced-precision accumulation): measurements only
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    sa = tl.load(sa_ptr + rows, mask=rows < m, other=0.0)
    sb = tl.load(sb_ptr + cols, mask=cols < n, other=0.0)
    out = acc * sa[:, None] * sb[None, :]
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_c + cols[None, :],
             out.to(c_ptr.dtype.element_ty), mask=a_mask & b_mask)


def usable(a: torch.Tensor, b: torch.Tensor, config: Config | None) -> bool:
    return (config is not None and a.shape[1] % config[2] == 0 and a.stride(-1) == 1
            and b.stride(-1) == 1)


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
             out_dtype: torch.dtype, config: Config | None = None) -> torch.Tensor:
    """a [M, K] fp8, b [N, K] fp8, sa [M, 1], sb [N, 1] fp32 -> [M, N] out_dtype."""
    m, k = a.shape
    n = b.shape[0]
    # fp8_gemm is only called for shapes that `usable` accepted, so a config exists.
    block_m, block_n, block_k, warps, stages, acc_mode = config or config_for(m)  # type: ignore[misc]
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_gemm_kernel[grid](a, b, sa, sb, c, m, n, k, a.stride(0), b.stride(0), c.stride(0),
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                           ACC_MODE=acc_mode, num_warps=warps, num_stages=stages,
                           **pdl.options(a))
    return c
