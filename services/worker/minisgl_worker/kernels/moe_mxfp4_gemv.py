"""The decode path of the MXFP4 experts (moe_mxfp4.py): grouped GEMVs without tensor cores, for
batches whose (token, k) pairs are few (an expert sees 1-2 of them, so a tensor-core tile of 16
rows would waste most of its work and its dequantized tile would cost more than the bytes).

Same weights as the grouped GEMMs (moe_mxfp4_kernels.py), no second copy:
    w     uint8 [E, N, K // 2]   read here as int32 words: word j of a row holds elements
                                 8j..8j + 7, element 8j + i in bits 4i..4i + 3
    scale uint8 [E, N, K // 32]  one byte per 32 elements = per 4 words
A program owns BLOCK_P pairs of one expert (BLOCK_P = 1: one pair, routed straight from topk_ids;
2: a tile of `align_pairs`, so two pairs sharing an expert decode its bytes once) and BLOCK_N
output rows, and walks K in steps of BLOCK_K: per row and 32-block, a thread loads 16 bytes of
codes (one 128-bit load) and the scale byte straight into registers (nothing goes through shared
memory, so the 90-byte scale rows need no alignment), decodes in registers and accumulates
x . w in fp32, element-wise (one fma a weight and pair; the sums over K happen once, at the end).
x comes de-interleaved, x[t, i, j] = element 8j + i of row t (the host permutes the hidden
states, ~6 KB a token; gate_up writes its output so for down), so element i of a thread's 4 words
is one 8-byte load and every tensor of the loop shares one register layout (no shared-memory
layout conversions; Triton chose them when the 8 elements of a word were a tensor dimension).
The whole of K stays in one program (no split-K), so the gate_up epilogue has the
complete sums for its bias and clamped SwiGLU, and the down epilogue scales by the routing weight
and writes the pair's own row of the [T, K, H] buffer (the sum over k stays deterministic).

Decoding a code c (sign bit 3, magnitude bits 0-2) is integer bit moves, no table: the magnitude
bits placed at fp32 bits 22-24 and the sign at bit 31 read as e2m1(c) * 2^-126 (the e2m1
subnormal 0.5 becomes the fp32 subnormal 2^-127); one fp32 multiply by the block's 2^(s - 1)
(from the scale byte's bits) gives e2m1(c) * 2^(s - 127) exactly (fp32 multiplies keep
subnormal inputs: no flush-to-zero in these kernels, checked in the PTX by sm90_compile). Then
one fma a pair. The grid is (tiles, N strips), fixed by shapes: CUDA-graph safe.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import begin as _pdl_begin


@triton.jit
def _element(w, factor, IDX: tl.constexpr):
    """Element IDX (0..7) of each uint32 word, times factor (2^(s - 1), fp32): exactly
    e2m1 * 2^(s - 127). Bits 4i..4i+2 go to 22..24 and bit 4i+3 to 31 (one shift each, the
    masks and the or one 3-input logic op)."""
    if IDX * 4 <= 22:  # noqa: SIM108 - a constexpr branch: one shift direction compiled
        mag = (w << (22 - 4 * IDX)) & 0x01C00000
    else:
        mag = (w >> (4 * IDX - 22)) & 0x01C00000
    sign = (w << (28 - 4 * IDX)) & 0x80000000
    return (mag | sign).to(tl.float32, bitcast=True) * factor


@triton.jit
def _finish(acc, acc_u, pair, expert, rows, offs_n, out_ptr, weights_ptr, b_ptr, num_pairs,
            n_out, stride_ot, stride_be, alpha, limit, GATE_UP: tl.constexpr,
            HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr):
    """One pair's epilogue: the sums over K, bias, activation or routing weight, the store."""
    valid = pair < num_pairs
    safe = tl.where(valid, pair, 0).to(tl.int64)
    out = tl.sum(tl.sum(acc, axis=2), axis=1)  # [N]
    if HAS_BIAS:
        b_ptrs = b_ptr + expert * stride_be + rows
        out += tl.load(b_ptrs).to(tl.float32)
    if GATE_UP:
        up = tl.sum(tl.sum(acc_u, axis=2), axis=1)
        if HAS_BIAS:
            up += tl.load(b_ptrs + n_out).to(tl.float32)
        if CLAMPED:
            g = tl.minimum(out, limit)
            u = tl.minimum(tl.maximum(up, -limit), limit)
            out = (u + 1.0) * (g * tl.sigmoid(g * alpha))
        else:
            out = out * tl.sigmoid(out) * up
        cols = (offs_n % 8) * (n_out // 8) + offs_n // 8  # de-interleaved, as down reads x
    else:
        out *= tl.load(weights_ptr + safe).to(tl.float32)
        cols = offs_n
    ok = (offs_n < n_out) & (offs_n * 0 + pair < num_pairs)  # a vector mask (the interpreter)
    tl.store(out_ptr + safe * stride_ot + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["num_pairs"])
def mxfp4_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, sorted_ptr, expert_of_block_ptr,
                      num_padded_ptr, weights_ptr, b_ptr, num_pairs, n_out, k_in, stride_xt,
                      stride_we, stride_wn, stride_se, stride_sn, stride_ot, stride_be, alpha,
                      limit, TOPK: tl.constexpr, GATE_UP: tl.constexpr, ALIGNED: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
                      USE_PDL: tl.constexpr = False):
    """GATE_UP: out[pair, n] = act(x[token] . gate_e[n] + b, x[token] . up_e[n] + b), w holding
    the gate rows then the up rows (n_out = inter), out de-interleaved; else out[pair, n] =
    weight[pair] * (x[pair] . down_e[n] + b[e, n]) (n_out = hidden). w is the int32 view
    (strides in words); x rows de-interleaved (x[t, i, j]: element 8j + i). BLOCK_P is 1 or 2."""
    _pdl_begin(USE_PDL)
    tile = tl.program_id(0)
    strip = tl.program_id(1)
    if ALIGNED:
        if tile * BLOCK_P >= tl.load(num_padded_ptr):
            return
        pair0 = tl.load(sorted_ptr + tile * BLOCK_P)
        pair1 = tl.load(sorted_ptr + tile * BLOCK_P + BLOCK_P - 1)
        expert = tl.load(expert_of_block_ptr + tile).to(tl.int64)
    else:  # one pair a program, its expert from the routing
        pair0 = tile
        pair1 = tile
        expert = tl.load(ids_ptr + tile).to(tl.int64)
    # pad slots (pair >= num_pairs) read row 0 and store nothing
    row0 = tl.where(pair0 < num_pairs, pair0, 0).to(tl.int64)
    row1 = tl.where(pair1 < num_pairs, pair1, 0).to(tl.int64)
    if GATE_UP:
        row0 = row0 // TOPK
        row1 = row1 // TOPK

    G: tl.constexpr = BLOCK_K // 32
    offs_n = strip * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % n_out).to(tl.int64)  # wrap past the edge; those rows are not stored
    offs_g = tl.arange(0, G)
    offs_w = offs_g[:, None] * 4 + tl.arange(0, 4)[None, :]  # word within the step [G, 4]
    w_ptrs = (w_ptr + expert * stride_we + rows[:, None, None] * stride_wn
              + offs_w[None, :, :])
    s_ptrs = s_ptr + expert * stride_se + rows[:, None] * stride_sn + offs_g[None, :]
    # element i of a thread's 4 words: one vector load of the de-interleaved x
    x_plane = tl.multiple_of(k_in // 8, 4)  # K is whole 32-blocks: planes of whole 8 bytes
    x0_ptrs = x_ptr + row0 * stride_xt + offs_w
    x1_ptrs = x_ptr + row1 * stride_xt + offs_w
    acc0 = tl.zeros([BLOCK_N, G, 4], dtype=tl.float32)
    acc0_u = tl.zeros_like(acc0)
    acc1 = tl.zeros_like(acc0)
    acc1_u = tl.zeros_like(acc0)
    for k0 in range(0, k_in, BLOCK_K):
        if EVEN_K:
            wg = tl.load(w_ptrs)
            sg = tl.load(s_ptrs)
            if GATE_UP:
                wu = tl.load(w_ptrs + n_out * stride_wn)
                su = tl.load(s_ptrs + n_out * stride_sn)
        else:
            k_ok_s = offs_g[None, :] < (k_in - k0) // 32  # [1, G]: whole 32-blocks left
            wg = tl.load(w_ptrs, mask=k_ok_s[:, :, None], other=0)
            sg = tl.load(s_ptrs, mask=k_ok_s, other=0)
            if GATE_UP:
                wu = tl.load(w_ptrs + n_out * stride_wn, mask=k_ok_s[:, :, None], other=0)
                su = tl.load(s_ptrs + n_out * stride_sn, mask=k_ok_s, other=0)
        wg = wg.to(tl.uint32, bitcast=True)
        fg = (((sg.to(tl.int32) + 126) << 23).to(tl.float32, bitcast=True))[:, :, None]
        if GATE_UP:
            wu = wu.to(tl.uint32, bitcast=True)
            fu = (((su.to(tl.int32) + 126) << 23).to(tl.float32, bitcast=True))[:, :, None]
        x_ok = offs_w < (k_in - k0) // 8
        for i in tl.static_range(8):
            vg = _element(wg, fg, i)
            if GATE_UP:
                vu = _element(wu, fu, i)
            if EVEN_K:
                x0 = tl.load(x0_ptrs + i * x_plane).to(tl.float32)[None, :, :]
            else:
                x0 = tl.load(x0_ptrs + i * x_plane, mask=x_ok, other=0.0).to(tl.float32)
                x0 = x0[None, :, :]
            acc0 += x0 * vg
            if GATE_UP:
                acc0_u += x0 * vu
            if BLOCK_P == 2:
                if EVEN_K:
                    x1 = tl.load(x1_ptrs + i * x_plane).to(tl.float32)[None, :, :]
                else:
                    x1 = tl.load(x1_ptrs + i * x_plane, mask=x_ok, other=0.0).to(tl.float32)
                    x1 = x1[None, :, :]
                acc1 += x1 * vg
                if GATE_UP:
                    acc1_u += x1 * vu
        x0_ptrs += BLOCK_K // 8
        x1_ptrs += BLOCK_K // 8
        w_ptrs += BLOCK_K // 8
        s_ptrs += G

    _finish(acc0, acc0_u, pair0, expert, rows, offs_n, out_ptr, weights_ptr, b_ptr, num_pairs,
            n_out, stride_ot, stride_be, alpha, limit, GATE_UP, HAS_BIAS, CLAMPED)
    if BLOCK_P == 2:
        _finish(acc1, acc1_u, pair1, expert, rows, offs_n, out_ptr, weights_ptr, b_ptr,
                num_pairs, n_out, stride_ot, stride_be, alpha, limit, GATE_UP, HAS_BIAS,
                CLAMPED)
