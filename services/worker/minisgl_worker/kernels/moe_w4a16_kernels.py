"""The grouped W4A16 expert GEMM behind moe_w4a16.py: fused_moe_kernels.py's tiles (pairs
grouped by expert, BLOCK_M rows of one expert a tile, surplus tiles exit at once) with the
weights dequantized in registers by w4a16_kernels.dequant_half.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fused_moe_kernels import _tile_coords, tile_pairs
from .pdl import begin as _pdl_begin
from .w4a16_kernels import dequant_half, load_act_half, load_words, weight_cols


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def moe_w4_kernel(a_ptr, q_ptr, s_ptr, z_ptr, out_ptr, weights_ptr, sorted_ptr,
                  expert_of_block_ptr, num_padded_ptr, num_pairs, n_out, k, num_tiles_m,
                  stride_at, stride_qe, stride_qk, stride_se, stride_sg, stride_ot,
                  G: tl.constexpr, HAS_ZEROS: tl.constexpr, A_DIV: tl.constexpr,
                  GATE_UP: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                  BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One [BLOCK_M pairs, BLOCK_N] tile of an expert GEMM; a pair's input row is a[pair // A_DIV].

    GATE_UP: the weight [K=hidden, N=2*n_out] holds gate columns then up columns; a program
    computes BLOCK_N columns of both and stores silu(gate) * up [pairs, n_out].
    Otherwise (down): out[pair] = routing weight[pair] * (a[pair] @ W_e), n_out = hidden.
    """
    _pdl_begin(USE_PDL)
    tile_m, tile_n = _tile_coords(num_tiles_m, n_out, BLOCK_N, GROUP_M)
    if tile_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, valid, a_row, expert = tile_pairs(sorted_ptr, expert_of_block_ptr, tile_m, num_pairs,
                                            A_DIV, BLOCK_M)
    a_off = a_row * stride_at
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wcols = weight_cols(cols, n_out, EVEN_N, BLOCK_N)
    r = tl.arange(0, BLOCK_K // 8)
    q_ptrs = q_ptr + expert * stride_qe + r[:, None].to(tl.int64) * stride_qk + wcols[None, :]
    s_base = s_ptr + expert * stride_se
    z_base = z_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        words = load_words(q_ptrs, k0, k, EVEN_K, BLOCK_K)
        if GATE_UP:
            words_u = load_words(q_ptrs + n_out, k0, k, EVEN_K, BLOCK_K)
        for hi in tl.static_range(2):
            a = load_act_half(a_ptr, a_off, valid, k0, k, a_ptr, hi, False, EVEN_K, BLOCK_K)
            w = dequant_half(words, hi, k0, k, a_ptr, s_base, z_base, wcols, stride_sg, G,
                             HAS_ZEROS, False, EVEN_K, BLOCK_K)
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
            if GATE_UP:
                w = dequant_half(words_u, hi, k0, k, a_ptr, s_base, z_base, wcols + n_out,
                                 stride_sg, G, HAS_ZEROS, False, EVEN_K, BLOCK_K)
                acc_u = tl.dot(a, w.to(a.dtype), acc_u, input_precision=PRECISION)
        q_ptrs += (BLOCK_K // 8) * stride_qk

    if GATE_UP:
        acc = acc * tl.sigmoid(acc) * acc_u
    else:
        safe = tl.where(valid, rows, 0)
        acc *= tl.load(weights_ptr + safe).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < n_out))
