"""An fp8 GEMM with 128-wide K-group scales on both operands (Triton), for block-quantized
checkpoints (fp8_block.py has the format and the fp32 reference; layers/fp8_linear.py calls it).

y[m, n] = sum_g dot(qa[m, g], qb[n, g]) * sa[m, g] * sb[n, g]: each program owns a
[BLOCK_M, BLOCK_N] tile and walks K one 128-group at a time, the group's dot product promoted to
an fp32 accumulator with both scales applied (the promotion every 128 elements that Hopper's
reduced-precision fp8 accumulation needs anyway). A K that is not a multiple of 128 is masked
(its last group is short, with its own scales).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 128

# (max rows, BLOCK_M, BLOCK_N, num_warps, num_stages): narrow M tiles for decode batches,
# square ones for prefill. Not swept yet (correct first; tests/worker/test_prequant_fp8.py).
CONFIGS: list[tuple[int, int, int, int, int]] = [
    (16, 16, 64, 4, 3),
    (64, 64, 64, 4, 3),
    (1 << 62, 128, 128, 8, 3),
]


@triton.jit
def _fp8_block_gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, m, n, k, kg, stride_a, stride_b,
                           stride_c, stride_sa, stride_sb, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(m, BLOCK_M)
    pid_m, pid_n = pid % tiles_m, pid // tiles_m  # the M tiles of one N slab run together
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, GROUP_K)
    row_ok, col_ok = rows < m, cols < n
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_a + ks[None, :]
    b_ptrs = b_ptr + cols[None, :].to(tl.int64) * stride_b + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(0, kg):
        k_ok = g * GROUP_K + ks < k
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        sa = tl.load(sa_ptr + rows * stride_sa + g, mask=row_ok, other=0.0)
        sb = tl.load(sb_ptr + cols * stride_sb + g, mask=col_ok, other=0.0)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        a_ptrs += GROUP_K
        b_ptrs += GROUP_K
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_c + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, k, kg, stride_x, stride_q, stride_sm, stride_sg,
                         QMAX: tl.constexpr, GROUPS: tl.constexpr, GROUP_K: tl.constexpr):
    """GROUPS 128-wide groups of one row: q = x / s saturated, s = max|x| / QMAX per group."""
    row = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]
    ok = (cols < k) & (g[:, None] < kg)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30) / QMAX
    q = tl.clamp(x / s[:, None], -QMAX, QMAX)
    tl.store(q_ptr + row.to(tl.int64) * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, s, mask=g < kg)


def quantize_groups_fp8(x: torch.Tensor, col_major: bool = False, rows: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, s [M, ceil(K/128)] fp32): fp8_block.quantize_groups in one
    kernel. col_major lays s out K-group-major (stride (1, M)), as cuBLASLt's blockwise scaled
    GEMM wants its 1x128 activation scales. rows > M: that many rows, those past M zero."""
    m, k = x.shape
    kg = -(-k // GROUP)
    r = rows or m
    alloc = torch.zeros if r > m else torch.empty
    q = alloc(r, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = alloc(kg, r, device=x.device).t() if col_major else alloc(r, kg, device=x.device)
    if m:
        groups = min(8, triton.next_power_of_2(kg))
        _quant_groups_kernel[(m, triton.cdiv(kg, groups))](
            x, q, s, k, kg, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
            QMAX=float(torch.finfo(torch.float8_e4m3fn).max), GROUPS=groups, GROUP_K=GROUP,
            num_warps=4)
    return q, s


# cuBLASLt's blockwise fp8 GEMM (torch.nn.functional.scaled_mm, 1x128 activation and 128x128
# weight scales) serves from this many rows on: 1.4-1.7x faster than bf16 from 256 rows on an
# H200 where our Triton kernel is 2x slower than bf16 (bench/micro/fp8_block.py), and as fast as
# our kernel at 16; it refuses one row.
CUBLAS_MIN_ROWS = 16


def blockwise_available() -> bool:
    F = torch.nn.functional
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")


def whole_blocks(row_scales: torch.Tensor) -> torch.Tensor | None:
    """The [N/128, K/128] block scales behind per-row ones [N, K/128] when every 128 rows share
    theirs (the rows form whole checkpoint blocks: no packed part or TP shard starts inside a
    block) and cuBLASLt takes the grid, else None."""
    n, kg = row_scales.shape
    # cuBLASLt wants the block-scale grid in whole 4x4 tiles (N and K multiples of 512: every
    # projection of the served 7B+ shapes; a tiny model's layers take our Triton kernel)
    if n % (4 * GROUP) or kg % 4:
        return None
    chunks = row_scales.view(n // GROUP, GROUP, -1)
    if not bool((chunks == chunks[:, :1]).all()):
        return None
    return chunks[:, 0].contiguous()


def blockwise_mm(x: torch.Tensor, b: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16) @ W.T for fp8 b [N, K] with block scales [N/128, K/128]: x quantized per
    token and 128-group, then cuBLASLt. Its heuristics refuse row counts that are not a multiple
    of 8 (seen: 1, 2, 17): the quantized rows are padded to a multiple of 16 (their outputs are
    dropped)."""
    F = torch.nn.functional
    S = F.ScalingType
    m = x.shape[0]
    pad = -m % 16
    qx, sx = quantize_groups_fp8(x, col_major=True, rows=m + pad)
    y = F.scaled_mm(qx, b.t(), sx, S.BlockWise1x128, blocks.t(),
                    S.BlockWise128x128, output_dtype=x.dtype)
    return y[:m] if pad else y


def config_for(m: int) -> tuple[int, int, int, int]:
    for max_rows, *cfg in CONFIGS:
        if m <= max_rows:
            return cfg[0], cfg[1], cfg[2], cfg[3]
    raise AssertionError("the last config takes any row count")


def fp8_block_gemm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                   out_dtype: torch.dtype,
                   config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """a [M, K] fp8, b [N, K] fp8, sa [M, ceil(K/128)], sb [N, ceil(K/128)] fp32 ->
    [M, N] out_dtype."""
    m, k = a.shape
    n = b.shape[0]
    kg = -(-k // GROUP)
    assert b.shape[1] == k and sa.shape == (m, kg) and sb.shape == (n, kg), (
        a.shape, b.shape, sa.shape, sb.shape)
    assert a.stride(-1) == 1 and b.stride(-1) == 1 and sa.stride(-1) == 1 and sb.stride(-1) == 1
    block_m, block_n, warps, stages = config or config_for(m)
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_block_gemm_kernel[grid](a, b, sa, sb, c, m, n, k, kg, a.stride(0), b.stride(0),
                                 c.stride(0), sa.stride(0), sb.stride(0), BLOCK_M=block_m,
                                 BLOCK_N=block_n, GROUP_K=GROUP, num_warps=warps,
                                 num_stages=stages)
    return c
