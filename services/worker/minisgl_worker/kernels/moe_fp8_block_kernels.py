"""Triton kernels behind `moe_fp8_block`: per-token-group fp8 quantization and the two grouped
GEMMs of block-scaled fp8 experts (layout: quant/fp8_experts.py).

The grouped GEMMs follow fused_moe_kernels.py (pairs aligned by expert, one expert per BLOCK_M-row
tile, worst-case grids whose surplus tiles exit, no host reads: CUDA-graph safe). What differs is
the K loop: BLOCK_K divides 128, so every step lies in one 128-wide group g, and its fp8 dot is
added to the fp32 sums times the activation rows' group scale and the weight rows' block scale,
    acc += dot(qa[:, k-step], qw[k-step, :]) * sa[:, g] * sw[n // 128, g]
(the promotion every 128 elements that Hopper's narrow fp8 accumulator needs anyway).
SWAP_AB computes the transposed tile (weight rows on the MMA's M side, for 16-row decode
tiles), the same sums in the same order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fused_moe_kernels import _tile_coords, tile_pairs
from .pdl import begin as _pdl_begin

# globals a kernel reads must be constexpr
FP8_MAX: tl.constexpr = tl.constexpr(448.0)
TINY: tl.constexpr = tl.constexpr(1.1754943508222875e-38)  # the scale of an all-zero group


@triton.jit
def quant_groups_kernel(x_ptr, q_ptr, s_ptr, k, num_groups, stride_x, stride_q, stride_s,
                        GROUP: tl.constexpr, GROUPS: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Row `program_id(0)`, groups GROUPS * program_id(1) ...: q = x / s saturated, s =
    max|x_g| / 448 (a short last group is its own group)."""
    _pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = cols < k
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    # IEEE divisions (div_rn), as torch divides: Triton's `/` is approximate on the GPU
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), TINY)
    s = tl.math.div_rn(amax, tl.zeros_like(amax) + FP8_MAX)
    q = tl.math.div_rn(x, tl.zeros_like(x) + s[:, None])
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_s + g, s, mask=g < num_groups)


@triton.jit
def _scaled_dot(acc, a, w, sa, sw, SWAP_AB: tl.constexpr):
    """acc + (a . w) * sa[rows] * sw[cols], or with SWAP_AB the transposed tile's
    acc + (w . a) * sw[:, None] * sa[None, :]."""
    if SWAP_AB:
        acc += tl.dot(w, a) * (sw[:, None] * sa[None, :])
    else:
        acc += tl.dot(a, w) * (sa[:, None] * sw[None, :])
    return acc


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def gate_up_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_of_block_ptr,
                   num_padded_ptr, num_pairs, hidden, inter, num_tiles_m, up_block_rows,
                   stride_xt, stride_xst, stride_we, stride_wn, stride_wse, stride_wsn,
                   stride_ot, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                   SWAP_AB: tl.constexpr, USE_PDL: tl.constexpr = False):
    """out[pair, n] = silu(x[token] . w_gate[e, n]) * (x[token] . w_up[e, n]) for one tile, x
    fp8 with group scales xs [T, ceil(H/128)], w [E, 2*inter, H] fp8 with block scales ws
    [E, 2*up_block_rows, ceil(H/128)] (gate's block rows, then up's from up_block_rows)."""
    _pdl_begin(USE_PDL)
    tile_m, tile_n = _tile_coords(num_tiles_m, inter, BLOCK_N, GROUP_M)
    if tile_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, valid, token, expert = tile_pairs(sorted_ptr, expert_of_block_ptr, tile_m,
                                            num_pairs, TOPK, BLOCK_M)

    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = (offs_n % inter).to(tl.int64)  # wrap past the edge; those columns are not stored
    w_base = w_ptr + expert * stride_we
    if SWAP_AB:  # a [BLOCK_K, BLOCK_M], g/u [BLOCK_N, BLOCK_K]
        a_ptrs = x_ptr + token[None, :] * stride_xt + offs_k[:, None]
        g_ptrs = w_base + w_rows[:, None] * stride_wn + offs_k[None, :]
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:  # a [BLOCK_M, BLOCK_K], g/u [BLOCK_K, BLOCK_N]
        a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
        g_ptrs = w_base + w_rows[None, :] * stride_wn + offs_k[:, None]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    u_ptrs = g_ptrs + inter * stride_wn
    acc_u = tl.zeros_like(acc_g)
    xs_ptrs = xs_ptr + token * stride_xst
    gs_ptrs = ws_ptr + expert * stride_wse + (w_rows // 128) * stride_wsn
    us_ptrs = gs_ptrs + up_block_rows * stride_wsn
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = offs_k < hidden - k0
            k_a = k_ok[:, None] if SWAP_AB else k_ok[None, :]
            k_w = k_ok[None, :] if SWAP_AB else k_ok[:, None]
            a = tl.load(a_ptrs, mask=k_a, other=0.0)
            g = tl.load(g_ptrs, mask=k_w, other=0.0)
            u = tl.load(u_ptrs, mask=k_w, other=0.0)
        grp = k0 // 128
        sa = tl.load(xs_ptrs + grp)
        acc_g = _scaled_dot(acc_g, a, g, sa, tl.load(gs_ptrs + grp), SWAP_AB)
        acc_u = _scaled_dot(acc_u, a, u, sa, tl.load(us_ptrs + grp), SWAP_AB)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K

    if SWAP_AB:  # back to [BLOCK_M, BLOCK_N] for the epilogue
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < inter))


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def down_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, weights_ptr, sorted_ptr,
                expert_of_block_ptr, num_padded_ptr, num_pairs, hidden, inter, num_tiles_m,
                stride_at, stride_ast, stride_we, stride_wn, stride_wse, stride_wsn, stride_ot,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr,
                USE_PDL: tl.constexpr = False):
    """out[pair, n] = weight[pair] * (act[pair] . w_down[e, n]): act fp8 [pairs, inter] with
    group scales as [pairs, ceil(inter/128)], w [E, hidden, inter] fp8 with block scales ws
    [E, ceil(hidden/128), ceil(inter/128)]."""
    _pdl_begin(USE_PDL)
    tile_m, tile_n = _tile_coords(num_tiles_m, hidden, BLOCK_N, GROUP_M)
    if tile_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, valid, safe_rows, expert = tile_pairs(sorted_ptr, expert_of_block_ptr, tile_m,
                                                num_pairs, 1, BLOCK_M)

    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = (offs_n % hidden).to(tl.int64)
    w_base = w_ptr + expert * stride_we
    if SWAP_AB:  # a [BLOCK_K, BLOCK_M], b [BLOCK_N, BLOCK_K]
        a_ptrs = a_ptr + safe_rows[None, :] * stride_at + offs_k[:, None]
        b_ptrs = w_base + w_rows[:, None] * stride_wn + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:  # a [BLOCK_M, BLOCK_K], b [BLOCK_K, BLOCK_N]
        a_ptrs = a_ptr + safe_rows[:, None] * stride_at + offs_k[None, :]
        b_ptrs = w_base + w_rows[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    as_ptrs = as_ptr + safe_rows * stride_ast
    bs_ptrs = ws_ptr + expert * stride_wse + (w_rows // 128) * stride_wsn
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < inter - k0
            a = tl.load(a_ptrs, mask=k_ok[:, None] if SWAP_AB else k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[None, :] if SWAP_AB else k_ok[:, None], other=0.0)
        grp = k0 // 128
        acc = _scaled_dot(acc, a, b, tl.load(as_ptrs + grp), tl.load(bs_ptrs + grp), SWAP_AB)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if SWAP_AB:
        acc = tl.trans(acc)
    acc *= tl.load(weights_ptr + safe_rows).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < hidden))
