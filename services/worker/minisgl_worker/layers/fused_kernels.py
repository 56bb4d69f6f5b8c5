"""The Triton kernels behind fused_ops.py (imported on first use, so that importing the model
never imports triton: tests that run kernels under TRITON_INTERPRET=1 must import it first)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, x_s0, x_s1, res_s0, out_s0, heads,
                    n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
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
    tl.store(out_ptr + row * out_s0 + cols, (xf * inv * w).to(out_ptr.dtype.element_ty),
             mask=mask)

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
def _silu_mul_kernel(x_ptr, out_ptr, x_s0, out_s0, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(x_ptr + row * x_s0 + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_s0 + n + cols, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * out_s0 + cols, y.to(out_ptr.dtype.element_ty), mask=m)
