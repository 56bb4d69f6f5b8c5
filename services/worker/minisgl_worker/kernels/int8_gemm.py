"""INT8 W8A8 on the GPU (Triton): the activation quantization (one fused kernel: per-token amax,
scale, round half to even, saturate, int8 store; or a static scale) and the int8 GEMM with the
scales fused into its epilogue. The format and the reference formula: quant/int8.py.

    y[m, n] = (sum_k qx[m, k] * qw[n, k]) * sx[m] * sw[n]

tl.dot of int8 tiles accumulates exactly in int32 (Ampere/Hopper int8 tensor cores: twice the
bf16 rate, as fp8 on Hopper), so the result equals the reference up to the fp32 epilogue, which
runs in the same order. Small batches are memory-bound: the small-M configs tile like
kernels/fp8_gemm.py (narrow BLOCK_N slabs, long BLOCK_K, the weights streamed once for all rows);
larger ones use square tiles. torch._int_mm (cuBLAS, M > 16 only) needs an int32 [M, N] round
trip through memory for the scales; tests/gpu/test_int8.py measures both and `INT_MM_ROWS` says
from which batch it is used (None: never). Every launch is CUDA-graph safe: no host syncs, the
static scale read on the device.

Rounding: x / s is an IEEE division (div_rn, as torch's), and half-to-even rounding is done by
adding and subtracting 1.5 * 2^23 (exact for |v| < 2^22: the fp32 add rounds to even), so the
quantized rows equal quant/int8.quantize_rows' bit for bit, here and in the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fused_ops, pdl
from .pdl import begin as _pdl_begin

# (max rows, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the fp8 GEMM's small-M tiles
# (kernels/fp8_gemm.py, swept on an H100) and square tiles above; tests/gpu/test_int8.py --sweep
# re-measures them.
CONFIGS: list[tuple[int, int, int, int, int, int]] = [
    (16, 16, 32, 256, 4, 4),
    (64, 64, 32, 256, 4, 4),
    (256, 64, 128, 128, 4, 4),
    (1 << 62, 128, 128, 128, 8, 3),
]
INT_MM_ROWS: int | None = None  # from this many rows torch._int_mm + a torch epilogue instead

Config = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages


def config_for(m: int) -> Config:
    for max_rows, *cfg in CONFIGS:
        if m <= max_rows:
            return tuple(cfg)  # type: ignore[return-value]
    raise AssertionError("the last config covers every batch")


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, static_ptr, k, stride_x, stride_q,
                  BLOCK: tl.constexpr, STATIC: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Row `program_id` of x -> int8 q and its scale s (per token, or the static one)."""
    _pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    if STATIC:
        s = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for start in range(0, k, BLOCK):
            x = tl.load(x_row + start + offs, mask=start + offs < k, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        # the smallest normal fp32 for an all-zero row (quant/int8.py's _TINY)
        s = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 127.0), 1.1754943508222875e-38)
    tl.store(s_ptr + row, s)
    for start in range(0, k, BLOCK):
        mask = start + offs < k
        x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -129.0), 128.0)  # |v| < 2^22 below
        v = (v + 12582912.0) - 12582912.0  # 1.5 * 2^23: round half to even
        v = tl.minimum(tl.maximum(v, -128.0), 127.0)
        tl.store(q_ptr + row * stride_q + start + offs, v.to(tl.int8), mask=mask)


def quantize(x: torch.Tensor, static_scale: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q int8 [M, K], s fp32 [M, 1]); per token, or with a
    one-element static scale (a device tensor: nothing is read on the host)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    block = min(2048, triton.next_power_of_2(k))
    _quant_kernel[(m,)](x, q, s, static_scale if static_scale is not None else s, k,
                        x.stride(0), q.stride(0), BLOCK=block, STATIC=static_scale is not None,
                        num_warps=4, **pdl.options(x))
    return q, s


@triton.jit
def _int8_gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, m, n, k, stride_a, stride_b,
                      stride_c, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      USE_PDL: tl.constexpr = False):
    """c[m, n] = (sum_k a[m, k] * b[n, k]) * sa[m] * sb[n]; a, b int8 row-major (K-major, as
    Hopper's int8 wgmma wants both operands). Programs walk the M tiles of one N tile first,
    so a weight slab is fetched from memory once and re-read from L2 by the other M tiles."""
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    for start in range(0, k, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_mask, other=0)
            b = tl.load(b_ptrs, mask=b_mask, other=0)
        else:
            a = tl.load(a_ptrs, mask=a_mask & (start + ks[None, :] < k), other=0)
            b = tl.load(b_ptrs, mask=b_mask & (start + ks[:, None] < k), other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    sa = tl.load(sa_ptr + rows, mask=rows < m, other=0.0)
    sb = tl.load(sb_ptr + cols, mask=cols < n, other=0.0)
    out = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_c + cols[None, :],
             out.to(c_ptr.dtype.element_ty), mask=a_mask & b_mask)


def int8_gemm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
              out_dtype: torch.dtype, config: Config | None = None) -> torch.Tensor:
    """a [M, K] int8, b [N, K] int8 (rows contiguous), sa [M, 1], sb [N, 1] fp32 ->
    [M, N] out_dtype."""
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    block_m, block_n, block_k, warps, stages = config or config_for(m)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _int8_gemm_kernel[grid](a, b, sa, sb, c, m, n, k, a.stride(0), b.stride(0), c.stride(0),
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                            EVEN_K=k % block_k == 0, num_warps=warps, num_stages=stages,
                            **pdl.options(a))
    return c


def int_mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
           out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's int8 GEMM (M > 16, K and N multiples of 8) and the scales in torch."""
    acc = torch._int_mm(a, b.t())
    return (acc.float() * sa * sb.view(1, -1)).to(out_dtype)


def linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
           input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (w * w_scale).T with x quantized to int8 (per token, or input_scale) ->
    [M, N] in x's dtype. w int8 [N, K], w_scale fp32 [N, 1]. One CUDA row: weight-only."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if fused_ops.gemv_usable(x):
        # One row (bs=1 decode) reads every weight once: the GEMV streams the int8 rows with
        # their scales (the fp8 GEMV's kernel), the activation unrounded; the int8 GEMM's few
        # programs left HBM idle there (~55 us a projection on an H200).
        return fused_ops.gemv(x, w, w_scale=w_scale.view(-1))
    qx, sx = quantize(x, input_scale)
    m, k = qx.shape
    if (INT_MM_ROWS is not None and m >= max(INT_MM_ROWS, 17) and k % 8 == 0
            and w.shape[0] % 8 == 0):
        return int_mm(qx, w, sx, w_scale, x.dtype)
    return int8_gemm(qx, w, sx, w_scale, x.dtype)
