"""Triton kernels behind w4a16_gemm.py (and the dequantization helpers moe_w4a16_kernels.py
shares). The layout is quant/w4a16.py's: qweight int32 [K // 8, N], nibble j of packed row r is
canonical row 8r + j.

Dequantization without conversions. A packed row is split into its low and high halfword
(`words`, `words >> 16`); nibble j (j < 4) of a half is isolated with one AND against 0xF << 4j
and OR-ed into the mantissa of 2**23, which makes the fp32 2**23 + q * 16**j exactly (no
int-to-float conversion, which runs at a quarter of the FMA rate). One subtraction of
2**23 + z * 16**j leaves (q - z) * 16**j, exact; the factor 16**-j is folded into what
multiplies it (the activation in the GEMV, the scale in the GEMM tile). About 1.1 integer and
2 float operations a weight, so at decode batch sizes the kernels stay memory-bound.

K order inside a tile. A [BLOCK_K // 8, 4, BLOCK_N] half (rows 8r + j, or 8r + 4 + j) is reshaped
to [BLOCK_K // 2, BLOCK_N] without moving data, and the activation columns are loaded in the
same order: sum_k x_k w_k does not depend on the order of k, so no shuffle is needed.

Split-K. A program sums a K range; with SPLIT_K (a switch; `splits` counts them at run time, so
a new split count compiles nothing) the programs of one output tile store fp32 partials
[splits, M, N] and count themselves on a per-tile counter; the last to arrive sums the
partials in split order (deterministic), stores the output and resets the counter to 0. One
launch, no memset, no host sync: safe in CUDA graphs. The counters are touched only after the
PDL wait, so the next launch cannot see a counter mid-use.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import release as _pdl_release
from .pdl import wait as _pdl_wait


@triton.jit
def _pow16():
    """[4] fp32: 16**j for the nibble j of a halfword."""
    return (1 << (4 * tl.arange(0, 4))).to(tl.float32)


@triton.jit
def _magic(half):
    """int32 [R, N] halfwords -> fp32 [R, 4, N]: 2**23 + nibble_j * 16**j (exact)."""
    masks = 0xF << (4 * tl.arange(0, 4))
    bits = (half[:, None, :] & masks[None, :, None]) | 0x4B000000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _zero_term(z_ptr, g, cols, stride_z, HAS_ZEROS: tl.constexpr):  # 8388608 = 2**23
    """2**23 + z * 16**j for the rows of groups g ([R] or scalar-like [1]): fp32 [R, 4, N]
    (symmetric: z = 8, [1, 4, 1])."""
    p16 = _pow16()
    if HAS_ZEROS:
        z = tl.load(z_ptr + g[:, None].to(tl.int64) * stride_z + cols[None, :]).to(tl.float32)
        mz = z[:, None, :] * p16[None, :, None] + 8388608.0
    else:
        mz = (8.0 * p16 + 8388608.0)[None, :, None]
    return mz


@triton.jit
def _packed_rows(k0, k_end, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """First canonical row of each packed row of the tile at k0, [BLOCK_K // 8]; past k_end
    (a ragged last tile) clamped to the last packed row, so every index stays in bounds."""
    k = k0 + 8 * tl.arange(0, BLOCK_K // 8)
    if not EVEN_K:
        k = tl.minimum(k, k_end - 8)
    return k


@triton.jit
def _row_groups(k0, k_end, G: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Group of each packed row of the tile at k0: [1] when a tile is inside one group."""
    if G % BLOCK_K == 0:
        g = tl.full([1], 0, tl.int32) + k0 // G
    else:
        g = _packed_rows(k0, k_end, EVEN_K, BLOCK_K) // G
    return g


@triton.jit
def _act_cols(k0, k_end, perm_ptr, HI: tl.constexpr, HAS_PERM: tl.constexpr,
              EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """int32 [BLOCK_K // 8, 4]: the input feature of canonical rows 8r + (4 if HI) + j."""
    k = _packed_rows(k0, k_end, EVEN_K, BLOCK_K)
    c = k[:, None] + tl.arange(0, 4)[None, :] + 4 * HI
    if HAS_PERM:
        c = tl.load(perm_ptr + c)
    return c


@triton.jit
def _tail_mask(k0, k_end, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[1, BLOCK_K // 8, 1]: packed rows of the tile before k_end."""
    if EVEN_K:
        ok = tl.full([1, 1, 1], 1, tl.int1)
    else:
        ok = (k0 + 8 * tl.arange(0, BLOCK_K // 8) < k_end)[None, :, None]
    return ok


@triton.jit
def weight_cols(cols, n, EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight columns a tile reads: `cols` itself when N is a multiple of BLOCK_N (known
    contiguous: 16-byte loads), else wrapped past the edge (valid memory, never stored)."""
    return tl.max_contiguous(tl.multiple_of(cols, BLOCK_N), BLOCK_N) if EVEN_N else cols % n


@triton.jit
def load_words(q_ptrs, k0, k_end, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The packed tile at k0, [BLOCK_K // 8, BLOCK_N] int32 (rows past k_end read as 0)."""
    if EVEN_K:
        words = tl.load(q_ptrs)
    else:
        words = tl.load(q_ptrs, mask=(k0 + 8 * tl.arange(0, BLOCK_K // 8) < k_end)[:, None],
                        other=0)
    return words


@triton.jit
def _finish(y, rows, cols, M, N, out_ptr, stride_o, ws_ptr, cnt_ptr, tile, pid_k, splits,
            SPLIT_K: tl.constexpr):
    """Store y [BM, BN] fp32, or with split-K add up the tile's partials (see the module doc)."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows[:, None].to(tl.int64) * stride_o + cols[None, :]
    if not SPLIT_K:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = rows[:, None].to(tl.int64) * N + cols[None, :]
        plane = M.to(tl.int64) * N
        tl.store(ws_ptr + pid_k * plane + part, y, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the count says so
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == splits - 1:
            total = tl.zeros_like(y)
            for s in range(splits):
                total += tl.load(ws_ptr + s * plane + part, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch (graph replay)


# ------------------------------------------------------------------------------------------------
# Decode GEMV: no tensor cores, one activation row a program
# ------------------------------------------------------------------------------------------------


@triton.jit
def _gemv_step(acc, words, k0, x_row, perm_ptr, s_ptr, z_ptr, cols, stride_s, K,
               G: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
               EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BK8, BN] += s * sum_j x[8r + j] * (q_j - z), all in the layout of `words` (no
    shuffles between threads): nibble by nibble, 2D, the activation a [BK8] column each."""
    k = _packed_rows(k0, K, EVEN_K, BLOCK_K)
    g = _row_groups(k0, K, G, EVEN_K, BLOCK_K)
    g_off = g[:, None].to(tl.int64) * stride_s + cols[None, :]
    s = tl.load(s_ptr + g_off).to(tl.float32)
    z = tl.load(z_ptr + g_off).to(tl.float32) if HAS_ZEROS else tl.full([1, 1], 8.0, tl.float32)
    x_ok = k0 + 8 * tl.arange(0, BLOCK_K // 8) < K
    high = words >> 16
    part = tl.zeros_like(acc)
    for j in tl.static_range(8):
        c = k + j
        if HAS_PERM:
            c = tl.load(perm_ptr + c)
        xj = tl.load(x_row + c, mask=x_ok, other=0.0).to(tl.float32)
        xj = xj * (1.0 / (1 << (4 * (j % 4))))
        half = high if j >= 4 else words
        bits = (half & (0xF << (4 * (j % 4)))) | 0x4B000000
        w = bits.to(tl.float32, bitcast=True) - (z * (1 << (4 * (j % 4))) + 8388608.0)
        part += w * xj[:, None]
    return acc + part * s


@triton.jit(do_not_specialize=["M", "k_per_split", "splits"])
def w4_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, ws_ptr, cnt_ptr,
                   M, N, K, k_per_split, splits, stride_x, stride_q, stride_s, stride_o,
                   G: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
                   EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   USE_PDL: tl.constexpr = False):
    """out[m, N strip] = x[m] @ W.T over one K range (grid: rows, N tiles, splits; BLOCK_M is 1:
    the rows of one strip run side by side, so all but the first read the strip from L2). The
    first weight tile is loaded before the PDL wait (weights are never written while the model
    runs), so it streams while the kernel before finishes."""
    _pdl_release(USE_PDL)
    row, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wcols = weight_cols(cols, N, EVEN_N, BLOCK_N)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    r = tl.arange(0, BLOCK_K // 8)
    q_ptrs = q_ptr + (k_lo // 8 + r)[:, None].to(tl.int64) * stride_q + wcols[None, :]
    words = load_words(q_ptrs, k_lo, k_hi, EVEN_K, BLOCK_K)
    _pdl_wait(USE_PDL)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    acc = tl.zeros([BLOCK_K // 8, BLOCK_N], tl.float32)
    step = (BLOCK_K // 8) * stride_q
    for k0 in range(k_lo, k_hi, BLOCK_K):
        # The next tile is requested before this one is used (Triton does not pipeline loads
        # that feed no dot): two tiles in flight a program.
        q_ptrs += step
        ahead = tl.load(q_ptrs, mask=(k0 + BLOCK_K + 8 * r < k_hi)[:, None], other=0)
        acc = _gemv_step(acc, words, k0, x_row, perm_ptr, s_ptr, z_ptr, wcols, stride_s, k_hi,
                         G, HAS_ZEROS, HAS_PERM, EVEN_K, BLOCK_K)
        words = ahead
    y = tl.sum(acc, axis=0)[None, :]
    rows = row + tl.arange(0, 1)
    tile = pid_n * M + row
    _finish(y, rows, cols, M, N, out_ptr, stride_o, ws_ptr, cnt_ptr, tile, pid_k, splits,
            SPLIT_K)


# ------------------------------------------------------------------------------------------------
# Tensor-core GEMM: dequantized [BLOCK_K, BLOCK_N] tiles, scaled before the dot
# ------------------------------------------------------------------------------------------------


@triton.jit
def dequant_half(words, hi: tl.constexpr, k0, k_end, g_ptr, s_ptr, z_ptr, cols, stride_s,
                 G: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The low (hi=0) or high half of a packed tile, dequantized: fp32 [BLOCK_K // 2, BLOCK_N],
    row 4r + j holding canonical row k0 + 8r + 4*hi + j. Scale and zero rows come from
    k // G, or with HAS_GIDX from g_ptr (gidx) one canonical row at a time."""
    half = (words >> 16) if hi == 1 else words
    p16 = _pow16()
    if HAS_GIDX:
        k = _packed_rows(k0, k_end, EVEN_K, BLOCK_K)[:, None] + 4 * hi + tl.arange(0, 4)[None, :]
        g = tl.load(g_ptr + k).to(tl.int64)[:, :, None] * stride_s + cols[None, None, :]
        s = tl.load(s_ptr + g).to(tl.float32) / p16[None, :, None]
        if HAS_ZEROS:
            mz = tl.load(z_ptr + g).to(tl.float32) * p16[None, :, None] + 8388608.0
        else:
            mz = (8.0 * p16 + 8388608.0)[None, :, None]
    else:
        gr = _row_groups(k0, k_end, G, EVEN_K, BLOCK_K)
        mz = _zero_term(z_ptr, gr, cols, stride_s, HAS_ZEROS)
        sr = tl.load(s_ptr + gr[:, None].to(tl.int64) * stride_s + cols[None, :])
        s = sr.to(tl.float32)[:, None, :] / p16[None, :, None]
    w = (_magic(half) - mz) * s
    return tl.reshape(w, (BLOCK_K // 2, w.shape[2]))


@triton.jit
def load_act_half(x_ptr, rows_ptr_off, row_ok, k0, K, perm_ptr, hi: tl.constexpr,
                  HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Activation columns matching dequant_half's rows: [BM, BLOCK_K // 2]."""
    c = _act_cols(k0, K, perm_ptr, hi, HAS_PERM, EVEN_K, BLOCK_K)
    ok = row_ok[:, None, None] & _tail_mask(k0, K, EVEN_K, BLOCK_K)
    a = tl.load(x_ptr + rows_ptr_off[:, None, None] + c[None, :, :], mask=ok, other=0.0)
    return tl.reshape(a, (a.shape[0], BLOCK_K // 2))


@triton.jit
def tile_coords(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Program id -> (tile_m, tile_n): GROUP_M row tiles of one column tile run back to back
    (the weight tile is re-read from L2), then the next column tile."""
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit(do_not_specialize=["M", "k_per_split", "splits"])
def w4_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, perm_ptr, gidx_ptr, out_ptr, ws_ptr, cnt_ptr,
                   M, N, K, k_per_split, splits, stride_x, stride_q, stride_s, stride_o,
                   G: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
                   HAS_GIDX: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
                   USE_PDL: tl.constexpr = False):
    """out[M, N] = x[M, K] @ W.T, one [BLOCK_M, BLOCK_N] tile and K range a program (grid:
    tiles, splits); each K step is two dots of the dequantized halves."""
    _pdl_release(USE_PDL)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    tile_m, tile_n = tile_coords(tl.program_id(0), tiles_m, tiles_n, GROUP_M)
    pid_k = tl.program_id(1)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wcols = weight_cols(cols, N, EVEN_N, BLOCK_N)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    r = tl.arange(0, BLOCK_K // 8)
    q_ptrs = q_ptr + (k_lo // 8 + r)[:, None].to(tl.int64) * stride_q + wcols[None, :]
    row_ok = rows < M
    x_off = tl.where(row_ok, rows, 0).to(tl.int64) * stride_x
    _pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        words = load_words(q_ptrs, k0, k_hi, EVEN_K, BLOCK_K)
        for hi in tl.static_range(2):
            a = load_act_half(x_ptr, x_off, row_ok, k0, k_hi, perm_ptr, hi, HAS_PERM, EVEN_K,
                              BLOCK_K)
            w = dequant_half(words, hi, k0, k_hi, gidx_ptr, s_ptr, z_ptr, wcols, stride_s, G,
                             HAS_ZEROS, HAS_GIDX, EVEN_K, BLOCK_K)
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
        q_ptrs += (BLOCK_K // 8) * stride_q
    tile = tile_m * tiles_n + tile_n
    _finish(acc, rows, cols, M, N, out_ptr, stride_o, ws_ptr, cnt_ptr, tile, pid_k, splits,
            SPLIT_K)
