"""The W4A16 tensor-core GEMM (w4a16_gemm.py launches it for M >= 2): y = x @ W.T with W in
quant/w4a16.py's layout, dequantized in registers and fed to tl.dot.

Transposed tile. A program computes acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile.T: the dequantized
weight is the dot's first operand, which on Hopper wgmma may read straight from registers
(the second operand must sit in shared memory, and that is x, a plain pipelined load). So the
weight goes global -> shared (cp.async, pipelined by num_stages) -> registers -> dequantize ->
tensor cores, never back to shared memory; and a decode batch of 16 rows is wgmma's N side
(N=16 is legal), where an [M, N] tile would need 64 rows.

Weights as int16 halfwords (a K step is 4 dots of K = BLOCK_K // 4). qweight is read as int16
[K // 8, 2N]; the tile [BLOCK_N, BLOCK_K // 4] takes halfword c % 2 of packed row c // 2, i.e.
nibble t of tile column c is canonical row k0 + 4c + t. So nibble t of the whole tile is a
weight tile of the same shape, unpacked elementwise in whatever layout the dot wants, and its
partner is x's columns k0 + 4c + t: with X_PERMUTED the wrapper has reordered x's columns once
(x'[:, k0 + t * BLOCK_K // 4 + c] = x[:, k0 + 4c + t], act-order folded in, zero-padded to
whole steps) so each dot reads a contiguous slice; otherwise they are gathered from x (strided
2-byte loads cp.async cannot take: small M, tests). BLOCK_K >= 64: each dot has K >= 16.

Why 16-bit and not int32 words: Triton hoists the dequantization into the dot operand's
register layout (instead of a shared-memory round trip and a serializing wgmma wait a dot)
only through elementwise ops that never narrow a type; from int32 words the step to bf16 would
be a narrowing (trunc), from int16 it is shifts, masks and a bitcast. ptxas: 64x128x128 on 4
warps takes 189 registers, no spills; the loop has 7 cp.async loads, 3 shared -> register
loads (weights, scales, zeros straight into the dot layout), 4 wgmma, no convert_layout.

Dequantization without int-to-float conversions (a quarter-rate instruction that would compete
with the tensor cores at large M): nibble q OR-ed into the mantissa of B = 128 (bf16), 1024
(fp16) or 2**23 (fp32) is exactly B + q; minus (B + z), exact, times the group scale, in the
activation dtype (one rounding, as the reference's cast of (q - z) * s).

PACKED (W4Config.packed_dequant): the same values two a 32-bit register by inline PTX
(w4a16_packed.py: lop3 + two bf16x2/f16x2 fmas a pair, half the instructions a weight); with
BLOCK_M 16 and split-K it is also a decode kernel for M = 1 (rows masked, as Marlin pads them).

Split-K and the epilogue are w4a16_kernels._finish's (deterministic counter reduction).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import release as _pdl_release
from .pdl import wait as _pdl_wait
from .w4a16_kernels import _finish, tile_coords, weight_cols
from .w4a16_packed import dequant4


@triton.jit
def _nibble(half, t: tl.constexpr, DT: tl.constexpr):
    """int16 halfwords -> nibble t as the DT value B + q (exact, no conversion, no narrowing:
    Triton keeps an operand-A chain in registers only through ops that do not narrow)."""
    q = (half >> (4 * t)) & 0xF
    if DT == tl.bfloat16:  # noqa: SIM300 (a constexpr dtype, not a Yoda condition)
        v = (q | 0x4300).to(tl.bfloat16, bitcast=True)
    elif DT == tl.float16:  # noqa: SIM300
        v = (q | 0x6400).to(tl.float16, bitcast=True)
    else:
        v = (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
    return v


@triton.jit
def _group_params(s_ptr, z_ptr, g, wcols, stride_s, HAS_ZEROS: tl.constexpr,
                  DT: tl.constexpr, FULL: tl.constexpr = 0, NEG: tl.constexpr = False):
    """Scale and B + zero (NEG: -(B + zero)) for groups g (any shape broadcasting against
    [BLOCK_N, 1]): DT tensors [BLOCK_N, ...]."""
    # B: the float whose mantissa bits hold a nibble exactly (B + q), see _nibble
    B: tl.constexpr = (128.0 if DT == tl.bfloat16  # noqa: SIM300
                       else 1024.0 if DT == tl.float16 else 8388608.0)  # noqa: SIM300
    off = g.to(tl.int64) * stride_s + wcols[:, None]
    if FULL:
        off = tl.broadcast_to(off, (off.shape[0], FULL))
    s = tl.load(s_ptr + off).to(DT)
    if NEG:
        bz = ((-B) - tl.load(z_ptr + off).to(DT) if HAS_ZEROS
              else tl.full(off.shape, -8.0 - B, DT))
    else:
        bz = tl.load(z_ptr + off).to(DT) + B if HAS_ZEROS else tl.full([1, 1], 8.0 + B, DT)
    return s, bz


@triton.jit
def _gidx_params(gidx_ptr, k4, t: tl.constexpr, K, s_ptr, z_ptr, wcols, stride_s,
                 HAS_ZEROS: tl.constexpr, DT: tl.constexpr):
    """Scale and -(B + zero) of nibble t's rows by gidx: DT [BLOCK_N, len(k4)]."""
    gt = tl.load(gidx_ptr + tl.minimum(k4 + t, K - 1))[None, :]
    return _group_params(s_ptr, z_ptr, gt, wcols, stride_s, HAS_ZEROS, DT, k4.shape[0], True)


@triton.jit
def _x_cols(x_ptr, x_off, row_ok, c, c_ok, perm_ptr, HAS_PERM: tl.constexpr):
    """x tile transposed for the dot: [len(c), BLOCK_M], x[rows, perm[c] or c]."""
    if HAS_PERM:
        c = tl.load(perm_ptr + c, mask=c_ok, other=0)
    return tl.load(x_ptr + x_off[None, :] + c[:, None], mask=c_ok[:, None] & row_ok[None, :],
                   other=0.0)


@triton.jit
def _step(acc, x_ptr, x_off, row_ok, k0, k_hi, K, q_ptrs, s_ptr, z_ptr, perm_ptr,
                 gidx_ptr, wcols, stride_s, G: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 HAS_PERM: tl.constexpr, HAS_GIDX: tl.constexpr, X_PERMUTED: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr,
                 PRECISION: tl.constexpr, PACKED: tl.constexpr, ASM: tl.constexpr):
    """Four dots of K = BLOCK_K // 4: halfword column c of the tile holds canonical rows
    k0 + 4c + t, t = 0..3 (see the module doc). PACKED: the four weight tiles from one
    w4a16_packed.dequant4 (two weights a register with ASM)."""
    C: tl.constexpr = BLOCK_K // 4
    c = tl.arange(0, C)
    k4 = k0 + 4 * c  # canonical row of nibble 0 of each halfword
    if EVEN_K:
        c_ok = tl.full([C], 1, tl.int1)
        half = tl.load(q_ptrs)
    else:
        c_ok = k4 < k_hi
        half = tl.load(q_ptrs, mask=c_ok[None, :], other=0)
    if not HAS_GIDX:
        if G % BLOCK_K == 0:
            g = tl.full([1, 1], 0, tl.int32) + k0 // G
        else:
            g = (tl.minimum(k4, K - 4) // G)[None, :]
        s, bz = _group_params(s_ptr, z_ptr, g, wcols, stride_s, HAS_ZEROS, DT, C, PACKED)
        if PACKED:
            ws = dequant4(half, s, s, s, s, bz, bz, bz, bz, DT, ASM)
    elif PACKED:
        s0, z0 = _gidx_params(gidx_ptr, k4, 0, K, s_ptr, z_ptr, wcols, stride_s, HAS_ZEROS, DT)
        s1, z1 = _gidx_params(gidx_ptr, k4, 1, K, s_ptr, z_ptr, wcols, stride_s, HAS_ZEROS, DT)
        s2, z2 = _gidx_params(gidx_ptr, k4, 2, K, s_ptr, z_ptr, wcols, stride_s, HAS_ZEROS, DT)
        s3, z3 = _gidx_params(gidx_ptr, k4, 3, K, s_ptr, z_ptr, wcols, stride_s, HAS_ZEROS, DT)
        ws = dequant4(half, s0, s1, s2, s3, z0, z1, z2, z3, DT, ASM)
    for t in tl.static_range(4):
        if PACKED:
            w = ws[t]
        else:
            if HAS_GIDX:
                gt = tl.load(gidx_ptr + tl.minimum(k4 + t, K - 1))[None, :]
                s, bz = _group_params(s_ptr, z_ptr, gt, wcols, stride_s, HAS_ZEROS, DT, C)
            w = (_nibble(half, t, DT) - bz) * s
        if X_PERMUTED:  # x' zero-padded to whole BLOCK_K steps: no mask
            a = tl.load(x_ptr + x_off[None, :] + (k0 + t * C + c)[:, None],
                        mask=row_ok[None, :], other=0.0)
        else:
            a = _x_cols(x_ptr, x_off, row_ok, k4 + t, c_ok, perm_ptr, HAS_PERM)
        acc = tl.dot(w, a, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["M", "k_per_split", "splits"])
def w4_mma_kernel(x_ptr, q_ptr, s_ptr, z_ptr, perm_ptr, gidx_ptr, out_ptr, ws_ptr, cnt_ptr,
                  M, N, K, k_per_split, splits, stride_x, stride_q, stride_s, stride_o,
                  G: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
                  HAS_GIDX: tl.constexpr, X_PERMUTED: tl.constexpr,
                  EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  SPLIT_K: tl.constexpr, PRECISION: tl.constexpr = "tf32",
                  PACKED: tl.constexpr = False, ASM: tl.constexpr = False,
                  USE_PDL: tl.constexpr = False):
    """out[M, N] = x[M, K] @ W.T: one [BLOCK_M, BLOCK_N] output tile and K range a program
    (grid: tiles, splits), computed transposed (see the module doc). With X_PERMUTED, x_ptr is
    the reordered, zero-padded x' and HAS_PERM is False (folded in). PACKED: the
    dequantization of w4a16_packed.py (ASM: its inline PTX, bf16/fp16 on CUDA only)."""
    _pdl_release(USE_PDL)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    tile_m, tile_n = tile_coords(tl.program_id(0), tiles_m, tiles_n, GROUP_M)
    pid_k = tl.program_id(1)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wcols = weight_cols(cols, N, EVEN_N, BLOCK_N)
    row_ok = rows < M
    x_off = tl.where(row_ok, rows, 0).to(tl.int64) * stride_x
    k_lo = tl.multiple_of(pid_k * k_per_split, BLOCK_K)  # the wrapper's splits: whole steps
    k_hi = tl.minimum(K, k_lo + k_per_split)
    # q_ptr: qweight as int16 [K // 8, 2N]; tile column c is packed row c // 2, half c % 2
    c = tl.arange(0, BLOCK_K // 4)
    q_ptrs = q_ptr + (k_lo // 8 + c // 2)[None, :].to(tl.int64) * stride_q \
        + (2 * wcols[:, None] + (c % 2)[None, :])
    _pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for step in range(0, tl.cdiv(k_hi - k_lo, BLOCK_K)):
        k0 = k_lo + step * BLOCK_K
        acc = _step(acc, x_ptr, x_off, row_ok, k0, k_hi, K, q_ptrs, s_ptr, z_ptr, perm_ptr,
                    gidx_ptr, wcols, stride_s, G, HAS_ZEROS, HAS_PERM, HAS_GIDX, X_PERMUTED,
                    EVEN_K, BLOCK_K, DT, PRECISION, PACKED, ASM)
        q_ptrs += (BLOCK_K // 8) * stride_q
    tile = tile_m * tiles_n + tile_n
    _finish(tl.trans(acc), rows, cols, M, N, out_ptr, stride_o, ws_ptr, cnt_ptr, tile, pid_k,
            splits, SPLIT_K)
