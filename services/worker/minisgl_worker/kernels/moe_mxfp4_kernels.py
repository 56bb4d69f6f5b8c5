"""Triton kernels behind `moe_mxfp4`: the two grouped expert GEMMs of fused_moe_kernels.py with
MXFP4 weights (quant/mxfp4.py) dequantized in registers, bf16 activations (weight-only: Hopper
has no FP4 tensor cores).

Weights, per expert, rows = outputs, packed along K (the checkpoint's own byte order):
    w     uint8 [E, N, K // 2]   byte j: element 2j in bits 0-3, element 2j + 1 in bits 4-7
    scale uint8 [E, N, K // 32]  e8m0, 2^(s - 127) for 32 consecutive elements
A program loads [BLOCK_N, BLOCK_K // 2] bytes and [BLOCK_N, BLOCK_K // 32] scales per K step,
turns them into a [BLOCK_N, BLOCK_K] tile of the activations' dtype and feeds tl.dot: so the HBM
traffic is 4.25 bits a weight, and decode batches (memory-bound) move 3.8x fewer bytes than bf16.

The upcast (`_upcast`): with ASM (CUDA, bf16) a few PTX integer ops a 4-byte word, no lookup
table: a code's sign and its 3 exponent/mantissa bits are moved into a bf16's bit 15 and bits 6-8,
where they read as the e2m1 value times 2^-126 (code 1, the e2m1 subnormal 0.5, lands on the bf16
subnormal 2^-127, which bf16 arithmetic keeps), then one bf16x2 multiply by 2^(s - 1) a pair
applies the bias and the block scale at once, exactly (the product is an e2m1 value times a power
of two). 2^(s - 1) must be a finite bf16: s <= 128, checked at load (quant_load/mxfp4.py). Without
ASM (the interpreter, fp16/fp32 models) the same values by float arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fused_moe_kernels import _tile_coords, tile_pairs
from .pdl import begin as _pdl_begin

# For 4 bytes b0..b3 ($4) and their factors ($5: f0|f1, $6: f2|f3, bf16x2), the low nibbles'
# values ($0: b0|b1, $1: b2|b3) and the high nibbles' ($2, $3), each bf16x2. prmt puts b0 in
# byte 1 and b1 in byte 3 of w, so both halves of w hold one byte at bits 8-15: low nibble sign
# at bit 11, its exponent/mantissa at 8-10; high nibble sign at 15, exponent/mantissa at 12-14.
_UPCAST_ASM = """
{
.reg .b32 w, t, u, z, nz;
mov.b32 z, 0;
mov.b32 nz, 0x80008000;
prmt.b32 w, $4, z, 0x1404;
shl.b32 t, w, 4;
and.b32 t, t, 0x80008000;
shr.b32 u, w, 2;
and.b32 u, u, 0x01C001C0;
or.b32 t, t, u;
fma.rn.bf16x2 $0, t, $5, nz;
and.b32 t, w, 0x80008000;
shr.b32 u, w, 6;
and.b32 u, u, 0x01C001C0;
or.b32 t, t, u;
fma.rn.bf16x2 $2, t, $5, nz;
prmt.b32 w, $4, z, 0x3424;
shl.b32 t, w, 4;
and.b32 t, t, 0x80008000;
shr.b32 u, w, 2;
and.b32 u, u, 0x01C001C0;
or.b32 t, t, u;
fma.rn.bf16x2 $1, t, $6, nz;
and.b32 t, w, 0x80008000;
shr.b32 u, w, 6;
and.b32 u, u, 0x01C001C0;
or.b32 t, t, u;
fma.rn.bf16x2 $3, t, $6, nz;
}
"""
# What the kernels read: a jit function may read no globals but constexprs (the compiler
# refuses the rest; the interpreter does not check).
_UPCAST = tl.constexpr(_UPCAST_ASM)


@triton.jit
def _e2m1(code):
    """uint8 codes 0..15 -> fp32 e2m1 values."""
    mag = (code & 7).to(tl.int32)
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    pow2 = tl.where(e == 3, 4.0, tl.where(e == 2, 2.0, 1.0))
    v = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2)
    return tl.where(code >= 8, -v, v)


@triton.jit
def _upcast(codes, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
            DTYPE: tl.constexpr):
    """codes uint8 [BLOCK_N, BLOCK_K // 2], scales uint8 [BLOCK_N, BLOCK_K // 32] ->
    weights [BLOCK_N, BLOCK_K] in DTYPE (bf16 with ASM)."""
    if ASM:
        # 2^(s - 1) as bf16: exponent field s + 126 (s <= 128)
        f = ((scales.to(tl.int16) + 126) << 7).to(tl.bfloat16, bitcast=True)
        f = tl.broadcast_to(f[:, :, None], (BLOCK_N, BLOCK_K // 32, 16))
        f = tl.reshape(f, (BLOCK_N, BLOCK_K // 2))
        lo, hi = tl.inline_asm_elementwise(
            _UPCAST, "=r,=r,=r,=r,r,r,r", [codes, f], dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True, pack=4)
    else:
        # 2^(s - 127) from its bits (exact; s = 0, 2^-127, reads as 0)
        p = (scales.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        p = tl.broadcast_to(p[:, :, None], (BLOCK_N, BLOCK_K // 32, 16))
        p = tl.reshape(p, (BLOCK_N, BLOCK_K // 2))
        lo = (_e2m1(codes & 15) * p).to(DTYPE)
        hi = (_e2m1(codes >> 4) * p).to(DTYPE)
    return tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))


@triton.jit
def _weights(w_ptrs, s_ptrs, k_left, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             EVEN_K: tl.constexpr, ASM: tl.constexpr, DTYPE: tl.constexpr):
    """One K step's [BLOCK_N, BLOCK_K] weight tile; past `k_left` (a multiple of 32) zeros."""
    if EVEN_K:
        codes = tl.load(w_ptrs)
        scales = tl.load(s_ptrs)
    else:
        kb = tl.arange(0, BLOCK_K // 2)[None, :] < k_left // 2
        ks = tl.arange(0, BLOCK_K // 32)[None, :] < k_left // 32
        codes = tl.load(w_ptrs, mask=kb, other=0)
        scales = tl.load(s_ptrs, mask=ks, other=0)
    return _upcast(codes, scales, BLOCK_N, BLOCK_K, ASM, DTYPE)


@triton.jit
def _acts(a_ptrs, k_left, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr):
    # if/else, not an early return: Triton's compiler still lowers what follows a `return` in
    # a constexpr branch (the interpreter does not), so both paths must be well-formed apart.
    if EVEN_K:
        a = tl.load(a_ptrs)
    else:
        k_ok = tl.arange(0, BLOCK_K) < k_left
        a = tl.load(a_ptrs, mask=k_ok[:, None] if SWAP_AB else k_ok[None, :], other=0.0)
    return a


@triton.jit
def _mma(acc, a, w, SWAP_AB: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a . w^T ([BLOCK_M, BLOCK_N]), or with SWAP_AB acc + w . a ([BLOCK_N, BLOCK_M]: the
    weight rows on the MMA's M side, from registers, for decode tiles of few pair rows)."""
    if SWAP_AB:  # if/else (see _acts): the other branch's shapes do not match
        acc = tl.dot(w, a, acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def gate_up_kernel(x_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, expert_of_block_ptr, num_padded_ptr,
                   num_pairs, hidden, inter, num_tiles_m, stride_xt, stride_we, stride_wn,
                   stride_se, stride_sn, stride_ot, b_ptr, stride_be, alpha, limit,
                   TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                   PRECISION: tl.constexpr, SWAP_AB: tl.constexpr, ASM: tl.constexpr,
                   HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, USE_PDL: tl.constexpr = False):
    """out[pair, n] = act(x[token] . gate_e[n] + b, x[token] . up_e[n] + b) for one tile, as
    fused_moe_kernels.gate_up_kernel; w [E, 2 * inter, hidden / 2] holds the gate rows, then
    the up rows (b likewise), scales alike."""
    _pdl_begin(USE_PDL)
    tile_m, tile_n = _tile_coords(num_tiles_m, inter, BLOCK_N, GROUP_M)
    if tile_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, valid, token, expert = tile_pairs(sorted_ptr, expert_of_block_ptr, tile_m,
                                            num_pairs, TOPK, BLOCK_M)
    dtype: tl.constexpr = x_ptr.dtype.element_ty

    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = (offs_n % inter).to(tl.int64)  # wrap past the edge; those columns are not stored
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = (w_ptr + expert * stride_we + w_rows[:, None] * stride_wn
              + tl.arange(0, BLOCK_K // 2)[None, :])
    gs_ptrs = (s_ptr + expert * stride_se + w_rows[:, None] * stride_sn
               + tl.arange(0, BLOCK_K // 32)[None, :])
    u_ptrs = g_ptrs + inter * stride_wn
    us_ptrs = gs_ptrs + inter * stride_sn
    if SWAP_AB:
        a_ptrs = x_ptr + token[None, :] * stride_xt + offs_k[:, None]
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros_like(acc_g)
    for k0 in range(0, hidden, BLOCK_K):
        k_left = hidden - k0
        a = _acts(a_ptrs, k_left, BLOCK_K, EVEN_K, SWAP_AB)
        g = _weights(g_ptrs, gs_ptrs, k_left, BLOCK_N, BLOCK_K, EVEN_K, ASM, dtype)
        acc_g = _mma(acc_g, a, g, SWAP_AB, PRECISION)
        u = _weights(u_ptrs, us_ptrs, k_left, BLOCK_N, BLOCK_K, EVEN_K, ASM, dtype)
        acc_u = _mma(acc_u, a, u, SWAP_AB, PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K // 2
        u_ptrs += BLOCK_K // 2
        gs_ptrs += BLOCK_K // 32
        us_ptrs += BLOCK_K // 32

    if SWAP_AB:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    if HAS_BIAS:
        b_ptrs = b_ptr + expert * stride_be + w_rows
        acc_g += tl.load(b_ptrs).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + inter).to(tl.float32)[None, :]
    if CLAMPED:
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        act = (u + 1.0) * (g * tl.sigmoid(g * alpha))
    else:
        act = acc_g * tl.sigmoid(acc_g) * acc_u
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < inter))


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def down_kernel(a_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, sorted_ptr, expert_of_block_ptr,
                num_padded_ptr, num_pairs, hidden, inter, num_tiles_m, stride_at, stride_we,
                stride_wn, stride_se, stride_sn, stride_ot, b_ptr, stride_be,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                SWAP_AB: tl.constexpr, ASM: tl.constexpr, HAS_BIAS: tl.constexpr,
                USE_PDL: tl.constexpr = False):
    """out[pair, n] = weight[pair] * (act[pair] . down_e[n] + b[e, n]); w [E, hidden,
    inter / 2], scales [E, hidden, inter / 32]."""
    _pdl_begin(USE_PDL)
    tile_m, tile_n = _tile_coords(num_tiles_m, hidden, BLOCK_N, GROUP_M)
    if tile_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, valid, safe_rows, expert = tile_pairs(sorted_ptr, expert_of_block_ptr, tile_m,
                                                num_pairs, 1, BLOCK_M)
    dtype: tl.constexpr = a_ptr.dtype.element_ty

    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = (offs_n % hidden).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = (w_ptr + expert * stride_we + w_rows[:, None] * stride_wn
              + tl.arange(0, BLOCK_K // 2)[None, :])
    s_ptrs = (s_ptr + expert * stride_se + w_rows[:, None] * stride_sn
              + tl.arange(0, BLOCK_K // 32)[None, :])
    if SWAP_AB:
        a_ptrs = a_ptr + safe_rows[None, :] * stride_at + offs_k[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        a_ptrs = a_ptr + safe_rows[:, None] * stride_at + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_left = inter - k0
        a = _acts(a_ptrs, k_left, BLOCK_K, EVEN_K, SWAP_AB)
        w = _weights(w_ptrs, s_ptrs, k_left, BLOCK_N, BLOCK_K, EVEN_K, ASM, dtype)
        acc = _mma(acc, a, w, SWAP_AB, PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // 32

    if SWAP_AB:
        acc = tl.trans(acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + w_rows).to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + safe_rows).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < hidden))
