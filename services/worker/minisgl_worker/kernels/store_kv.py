"""Write new K/V rows into the paged pool at flat slots (page * page_size + offset).

One program per token writes both K and V of all KV heads. A negative slot means "nowhere" (a
padded CUDA-graph row): the program stores nothing, so padding never touches a live page.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import kv_saturation


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
    PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, CACHE_MAX: tl.constexpr = 0.0,
):
    t = tl.program_id(0)
    loc = tl.load(loc_ptr + t).to(tl.int64)
    if loc < 0:
        return
    page = loc // PAGE_SIZE
    off = loc % PAGE_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    src = t.to(tl.int64)
    k = tl.load(k_ptr + src * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + src * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if CACHE_MAX > 0:  # an fp8 cache: saturate instead of overflowing to inf/NaN
        k = tl.minimum(tl.maximum(k.to(tl.float32), -CACHE_MAX), CACHE_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32), -CACHE_MAX), CACHE_MAX)
    tl.store(k_cache_ptr + page * stride_kcp + off * stride_kct + h[:, None] * stride_kch
             + d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + page * stride_vcp + off * stride_vct + h[:, None] * stride_vch
             + d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             loc: torch.Tensor) -> None:
    """k, v [T, num_kv_heads, head_dim] -> the pool at flat slots loc [T] (int32/int64)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PAGE_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        CACHE_MAX=kv_saturation(k_cache.dtype),
        num_warps=1 if num_kv_heads * head_dim <= 256 else 4,
    )
