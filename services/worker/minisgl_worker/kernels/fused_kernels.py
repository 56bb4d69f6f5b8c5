"""The Triton kernels behind fused_ops.py (imported on first use, so that importing the model
never imports triton: tests that run kernels under TRITON_INTERPRET=1 must import it first)."""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import begin as _pdl_begin
from .pdl import release as _pdl_release
from .pdl import wait as _pdl_wait


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, x_s0, x_s1, res_s0, out_s0, heads,
                    n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                    QUANT: tl.constexpr, QMAX: tl.constexpr, USE_PDL: tl.constexpr = False):
    """QUANT: the normed row, rounded to the activation dtype, is quantized to fp8 as
    _quant_rows_kernel does (out fp8, scale_ptr[row] its scale), without the bf16 row's round
    trip through memory: the two kernels' bytes and scales, except that on an H100 ~15 in 10^8
    bytes come out one fp8 step apart, scales equal (cause not pinned down; no warps setting
    changes it, and _quant_rows_kernel alone equals torch's cast byte for byte)."""
    _pdl_begin(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x_off = (row // heads) * x_s0 + (row % heads) * x_s1
    x = tl.load(x_ptr + x_off + cols, mask=mask, other=0.0)
    if HAS_RES:  # residual += x (in the activation dtype, as HF adds), then norm of that
        x = x + tl.load(res_ptr + row * res_s0 + cols, mask=mask, other=0.0)
        tl.store(res_ptr + row * res_s0 + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * inv * w).to(x_ptr.dtype.element_ty)
    if QUANT:
        yf = y.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(yf), axis=0), 1.1754943508222875e-38) / QMAX
        tl.store(scale_ptr + row, scale)
        _store_quantized(out_ptr + row * out_s0, cols, mask, yf, scale, QMAX, BLOCK)
    else:
        tl.store(out_ptr + row * out_s0 + cols, y, mask=mask)


@triton.jit
def _inv_rms(ptrs, mask, n_cols, eps):
    """1/rms of each row of a [rows, BLOCK_D] tile, statistics in fp32. The per-head norm kernel
    and the fused attention prologue both call this on the same per-token tile with 4 warps, so
    Triton gives the sum the same layout (sm_90 TTGIR: sizePerThread [1, 8], threadsPerWarp
    [2, 16] for bf16 [H, 128]) and both reduce in the same order: identical bits."""
    xf = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)


@triton.jit
def _head_rmsnorm_kernel(x_ptr, w_ptr, out_ptr, n_tokens, x_s0, x_s1, n_cols, eps,
                         HEADS: tl.constexpr, TOKENS: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    # Per-head q/k norm: one program takes all heads of TOKENS tokens (a 128-wide row alone
    # leaves most of a 4-warp program idle). out is [T, HEADS, n_cols] contiguous.
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    m = (h < HEADS) & (d < n_cols)
    w = tl.load(w_ptr + d, mask=d < n_cols, other=0.0).to(tl.float32)
    for i in range(TOKENS):
        t = (tl.program_id(0) * TOKENS + i).to(tl.int64)
        if t < n_tokens:
            p = x_ptr + t * x_s0 + h * x_s1 + d
            inv = _inv_rms(p, m, n_cols, eps)[:, None]
            xf = tl.load(p, mask=m, other=0.0).to(tl.float32)
            tl.store(out_ptr + (t * HEADS + h) * n_cols + d,
                     (xf * inv * w).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, q_s0, q_s1, k_s0, k_s1, cache_s0,
                 HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    cos = tl.load(cos_ptr + pos * cache_s0 + d, mask=dm, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * cache_s0 + d, mask=dm, other=0.0)[None, :]
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    qp = q_ptr + t * q_s0 + hq * q_s1 + d[None, :]
    qm = (hq < HQ) & dm[None, :]
    x1 = tl.load(qp, mask=qm, other=0.0).to(tl.float32)
    x2 = tl.load(qp + HALF, mask=qm, other=0.0).to(tl.float32)
    tl.store(qp, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=qm)
    tl.store(qp + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=qm)
    hk = tl.arange(0, BLOCK_HK)[:, None]
    kp = k_ptr + t * k_s0 + hk * k_s1 + d[None, :]
    km = (hk < HK) & dm[None, :]
    y1 = tl.load(kp, mask=km, other=0.0).to(tl.float32)
    y2 = tl.load(kp + HALF, mask=km, other=0.0).to(tl.float32)
    tl.store(kp, (y1 * cos - y2 * sin).to(k_ptr.dtype.element_ty), mask=km)
    tl.store(kp + HALF, (y2 * cos + y1 * sin).to(k_ptr.dtype.element_ty), mask=km)

@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, x_s0, out_s0, n, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    _pdl_begin(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(x_ptr + row * x_s0 + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_s0 + n + cols, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * out_s0 + cols, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _embedding_shard_kernel(ids_ptr, w_ptr, out_ptr, start, local, d, w_s0, out_s0,
                            BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Row `ids[t] - start` of this rank's vocabulary block, or zeros for an id another rank
    holds: one token a program (the torch form is ~7 launches, a tenth of a batch-1 step's
    non-GEMV time at TP=2)."""
    _pdl_begin(USE_PDL)
    t = tl.program_id(0)
    local_id = tl.load(ids_ptr + t).to(tl.int64) - start
    mine = (local_id >= 0) & (local_id < local)
    cols = tl.arange(0, BLOCK)
    row = tl.load(w_ptr + tl.where(mine, local_id, 0) * w_s0 + cols,
                  mask=cols < tl.where(mine, d, 0), other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * out_s0 + cols, row, mask=cols < d)


@triton.jit
def _load_heads(ptr, s1, n_cols, eps, H: tl.constexpr, HALF: tl.constexpr,
                HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_HALF: tl.constexpr):
    """The H heads of one token (s1 apart from ptr) as fp32 halves [BLOCK_H, BLOCK_HALF], and
    each head's 1/rms [BLOCK_H, 1] if HAS_NORM (from a full-row load, L1 hits: the same tile
    and reduction as _head_rmsnorm_kernel, which halves would not give)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    m = (h < H) & (d < HALF)
    x1 = tl.load(ptr + h * s1 + d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + h * s1 + HALF + d, mask=m, other=0.0).to(tl.float32)
    if HAS_NORM:
        full = tl.arange(0, BLOCK_D)[None, :]
        inv = _inv_rms(ptr + h * s1 + full, (h < H) & (full < n_cols), n_cols, eps)[:, None]
    else:
        inv = tl.full([BLOCK_H, 1], 1.0, tl.float32)
    return x1, x2, inv


@triton.jit
def _rope_heads_(ptr, s1, x1, x2, inv, w1, w2, cos, sin, H: tl.constexpr, HALF: tl.constexpr,
                 HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Norm (if HAS_NORM) and rotate what _load_heads gave, store it back at ptr; returns the
    rotated halves in ptr's dtype. The arithmetic of _head_rmsnorm_kernel then _rope_kernel:
    the normed value rounded to the activation dtype (the unfused path stores it in between),
    rotated in fp32, rounded once; expressions written as there, so FMA contraction matches."""
    dt = ptr.dtype.element_ty
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    m = (h < H) & (d < HALF)
    if HAS_NORM:
        x1 = (x1 * inv * w1).to(dt).to(tl.float32)
        x2 = (x2 * inv * w2).to(dt).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(dt)
    y2 = (x2 * cos + x1 * sin).to(dt)
    tl.store(ptr + h * s1 + d, y1, mask=m)
    tl.store(ptr + h * s1 + HALF + d, y2, mask=m)
    return y1, y2


@triton.jit
def _to_cache(x, cache_ptr, CACHE_MAX: tl.constexpr):
    """x in the KV cache's element type; CACHE_MAX > 0 (an fp8 cache): clamped to its finite
    range first, so a large activation saturates instead of becoming inf/NaN."""
    if CACHE_MAX > 0:
        xf = x.to(tl.float32)
        x = tl.minimum(tl.maximum(xf, -CACHE_MAX), CACHE_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _qk_norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr, loc_ptr,
    n_tokens, q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, cs_s0,
    kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, n_cols, eps,
    HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr, TOKENS: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
    CACHE_MAX: tl.constexpr = 0.0, USE_PDL: tl.constexpr = False,
):
    # One layer's attention prologue for TOKENS tokens per program: q heads normed + rotated in
    # place; k heads normed + rotated in place and into the K cache; v copied into the V cache.
    # A negative slot (padding) writes no cache row, but q/k are still done (attention reads q).
    _pdl_begin(USE_PDL)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dm = d < HALF
    hk = tl.arange(0, BLOCK_HK)[:, None]
    dv = tl.arange(0, BLOCK_D)[None, :]
    vm = (hk < HK) & (dv < n_cols)
    if HAS_NORM:
        qw1 = tl.load(qw_ptr + d, mask=dm, other=0.0).to(tl.float32)
        qw2 = tl.load(qw_ptr + HALF + d, mask=dm, other=0.0).to(tl.float32)
        kw1 = tl.load(kw_ptr + d, mask=dm, other=0.0).to(tl.float32)
        kw2 = tl.load(kw_ptr + HALF + d, mask=dm, other=0.0).to(tl.float32)
    else:
        qw1 = tl.full([1, BLOCK_HALF], 1.0, tl.float32)  # unread without norms
        qw2, kw1, kw2 = qw1, qw1, qw1
    for i in range(TOKENS):
        t = (tl.program_id(0) * TOKENS + i).to(tl.int64)
        if t < n_tokens:
            # Every load first: q's stores may alias k/v for all the compiler knows, so loads
            # placed after them would wait for them (three memory round trips instead of one).
            pos = tl.load(pos_ptr + t)
            loc = tl.load(loc_ptr + t).to(tl.int64)
            cos = tl.load(cos_ptr + pos * cs_s0 + d, mask=dm, other=0.0)
            sin = tl.load(sin_ptr + pos * cs_s0 + d, mask=dm, other=0.0)
            vals = tl.load(v_ptr + t * v_s0 + hk * v_s1 + dv, mask=vm, other=0.0)
            q1, q2, q_inv = _load_heads(q_ptr + t * q_s0, q_s1, n_cols, eps, HQ, HALF, HAS_NORM,
                                        BLOCK_HQ, BLOCK_D, BLOCK_HALF)
            k1, k2, k_inv = _load_heads(k_ptr + t * k_s0, k_s1, n_cols, eps, HK, HALF, HAS_NORM,
                                        BLOCK_HK, BLOCK_D, BLOCK_HALF)
            _rope_heads_(q_ptr + t * q_s0, q_s1, q1, q2, q_inv, qw1, qw2, cos, sin, HQ, HALF,
                         HAS_NORM, BLOCK_HQ, BLOCK_HALF)
            y1, y2 = _rope_heads_(k_ptr + t * k_s0, k_s1, k1, k2, k_inv, kw1, kw2, cos, sin, HK,
                                  HALF, HAS_NORM, BLOCK_HK, BLOCK_HALF)
            if loc >= 0:
                page, off = loc // PAGE_SIZE, loc % PAGE_SIZE
                kc = kc_ptr + page * kc_s0 + off * kc_s1 + hk * kc_s2 + d
                km = (hk < HK) & dm
                tl.store(kc, _to_cache(y1, kc_ptr, CACHE_MAX), mask=km)
                tl.store(kc + HALF, _to_cache(y2, kc_ptr, CACHE_MAX), mask=km)
                tl.store(vc_ptr + page * vc_s0 + off * vc_s1 + hk * vc_s2 + dv,
                         _to_cache(vals, vc_ptr, CACHE_MAX), mask=vm)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, n_rows, k, stride_w, HAS_BIAS: tl.constexpr,
                 HAS_SCALE: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False, stride_s=0,
                 SCALE_GROUP: tl.constexpr = 0):
    """y[n] = sum_k w[n, k] * x[k] (* s[n]) (+ b[n]) for BLOCK_N rows of w per program; with
    SILU_MUL x is the [gate | up] row of length 2k and the input is silu(gate) * up, rounded to
    the activation dtype as _silu_mul_kernel stores it. HAS_SCALE: w is fp8 with one scale a
    row (the activation stays in its dtype). fp32 accumulation.
    Under PDL the first BLOCK_K columns of w are loaded before waiting for the kernel before
    (weights are never written while the model runs): programs resident early stream them while
    that kernel (a norm, the attention merge) finishes. (Two slices ahead was slower on an
    H100: 161 against 171 tok/s at bs=1, Qwen3-8B bf16.)"""
    _pdl_release(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & (cols < k)[None, :], other=0.0)
    _pdl_wait(USE_PDL)
    acc = w.to(tl.float32) * _act(x_ptr, 0, cols, cols < k, k, SILU_MUL)[None, :]
    if SCALE_GROUP > 0:
        acc = _scale_groups(acc, s_ptr, rows, row_mask, 0, k, stride_s, BLOCK_N, BLOCK_K,
                            SCALE_GROUP)
    for k0 in range(BLOCK_K, k, BLOCK_K):
        c = k0 + cols
        c_mask = c < k
        w = tl.load(w_rows + c[None, :], mask=row_mask[:, None] & c_mask[None, :], other=0.0)
        part = w.to(tl.float32) * _act(x_ptr, 0, c, c_mask, k, SILU_MUL)[None, :]
        if SCALE_GROUP > 0:
            part = _scale_groups(part, s_ptr, rows, row_mask, k0, k, stride_s, BLOCK_N, BLOCK_K,
                                 SCALE_GROUP)
        acc += part
    y = tl.sum(acc, axis=1)
    if HAS_SCALE and SCALE_GROUP == 0:
        y *= tl.load(s_ptr + rows, mask=row_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _scale_groups(part, s_ptr, rows, row_mask, k0, k, stride_s, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SCALE_GROUP: tl.constexpr):
    """part [BLOCK_N, BLOCK_K] products from column k0 on, summed per SCALE_GROUP-wide group and
    scaled by the rows' group scales, put back as [BLOCK_N, BLOCK_K] (one nonzero column per
    group: the caller's final row sum adds them)."""
    ng: tl.constexpr = BLOCK_K // SCALE_GROUP
    sums = tl.sum(tl.reshape(part, [BLOCK_N, ng, SCALE_GROUP]), axis=2)  # [BLOCK_N, ng]
    g = k0 // SCALE_GROUP + tl.arange(0, ng)
    s = tl.load(s_ptr + rows[:, None] * stride_s + g[None, :],
                mask=row_mask[:, None] & (g * SCALE_GROUP < k)[None, :], other=0.0)
    scaled = sums * s
    first = (tl.arange(0, BLOCK_K) % SCALE_GROUP) == 0
    spread = tl.reshape(tl.broadcast_to(scaled[:, :, None], [BLOCK_N, ng, SCALE_GROUP]),
                        [BLOCK_N, BLOCK_K])
    return tl.where(first[None, :], spread, 0.0)


@triton.jit
def _act(x_ptr, row_off, c, c_mask, k, SILU_MUL: tl.constexpr):
    """Columns c of an activation row in fp32: x itself, or with SILU_MUL silu(gate) * up of a
    [gate | up] row, rounded to the activation dtype as _silu_mul_kernel stores it."""
    if SILU_MUL:
        g = tl.load(x_ptr + row_off + c, mask=c_mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row_off + k + c, mask=c_mask, other=0.0).to(tl.float32)
        return (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty).to(tl.float32)
    return tl.load(x_ptr + row_off + c, mask=c_mask, other=0.0).to(tl.float32)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, k, stride_x, stride_q, QMAX: tl.constexpr,
                       SILU_MUL: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    """Dynamic per-row fp8 quantization of one activation row per program: s = max|x| / QMAX
    (a zero row gets the smallest normal fp32 instead), q = x / s saturated at +-QMAX. With
    ONE_PASS the row fits one BLOCK and is read once; otherwise twice (then from L1/L2)."""
    _pdl_begin(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        v = _act(x_ptr, row * stride_x, cols, cols < k, k, SILU_MUL)
        scale = tl.maximum(tl.max(tl.abs(v), axis=0), 1.1754943508222875e-38) / QMAX
        tl.store(s_ptr + row, scale)
        _store_quantized(q_ptr + row * stride_q, cols, cols < k, v, scale, QMAX, BLOCK)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, k, BLOCK):
            c = k0 + cols
            amax = tl.maximum(amax, tl.abs(_act(x_ptr, row * stride_x, c, c < k, k, SILU_MUL)))
        scale = tl.maximum(tl.max(amax, axis=0), 1.1754943508222875e-38) / QMAX
        tl.store(s_ptr + row, scale)
        for k0 in range(0, k, BLOCK):
            c = k0 + cols
            v = _act(x_ptr, row * stride_x, c, c < k, k, SILU_MUL)
            _store_quantized(q_ptr + row * stride_q, c, c < k, v, scale, QMAX, BLOCK)


@triton.jit
def _store_quantized(q_row_ptr, c, mask, v, scale, QMAX: tl.constexpr, BLOCK: tl.constexpr):
    v = tl.math.div_rn(v, tl.zeros([BLOCK], tl.float32) + scale)  # IEEE division, as torch
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    tl.store(q_row_ptr + c, v.to(q_row_ptr.dtype.element_ty), mask=mask)
