"""Paged prefill / extend attention: packed new tokens attend to their request's cached prefix and,
causally, to each other.

Request b owns query rows cu_q_lens[b] : cu_q_lens[b + 1] at absolute positions prefix_lens[b] + i,
and its KV (prefix and new tokens, already stored in the pool) through its page-table row. New
token i sees KV positions [0, prefix_lens[b] + i]. One program per (request, head, block of
BLOCK_M queries); blocks past a request's length exit at once, so the grid only needs the longest
request of the batch. Chunked prefill (a prefix from earlier chunks) and mixed batches (decode rows
are extends of one token) go through the same kernel.

A sliding-window layer (WINDOW > 0) starts each query block's loop at the block holding the first
key its earliest query sees and masks keys more than WINDOW - 1 positions back; attention sinks
(one logit a head, no value) join each row's denominator at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
LOG2E: tl.constexpr = tl.constexpr(_LOG2E)


# The page table's row stride is the widest row of the step's batch: not specialised (Triton
# compiles a variant per value class of an int, 1 / a multiple of 16 / other), or a server's
# first batches of each class stall while one compiles (tests/gpu/test_compiles.py).
@triton.jit(do_not_specialize=["stride_pt"])
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, page_table_ptr, rows_ptr, cu_q_ptr, prefix_ptr, sinks_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_pt,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, WINDOW: tl.constexpr = 0, HAS_SINKS: tl.constexpr = False,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    prefix = tl.load(prefix_ptr + b)
    row = tl.load(rows_ptr + b).to(tl.int64)
    kvh = h // GROUP

    i = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    i_mask = i < q_len
    d_mask = d < HEAD_DIM
    tok = (q_start + i).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=i_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix + i

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The last query of this block sees up to this position (exclusive bound).
    kv_end = prefix + tl.minimum(q_len, (mb + 1) * BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    kv_start = 0
    if WINDOW > 0:  # the block's earliest query sees back to prefix + mb * BLOCK_M - WINDOW + 1
        kv_start = (tl.maximum(prefix + mb * BLOCK_M - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
    for s in range(kv_start, kv_end, BLOCK_N):
        t = s + n
        t_mask = t < kv_end
        page = tl.load(page_table_ptr + row * stride_pt + t // PAGE_SIZE, mask=t_mask, other=0)
        page = page.to(tl.int64)
        off = t % PAGE_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kp + off[:, None] * stride_kt
                    + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = t_mask[None, :] & (t[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (t[None, :] > q_pos[:, None] - WINDOW)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        # A row that has seen no key yet (a window starting in a later block; a padding row)
        # keeps m = -inf: subtract 0 instead, so its p and alpha stay 0 rather than NaN.
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + page[:, None] * stride_vp + off[:, None] * stride_vt
                    + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * LOG2E
        l_i = l_i + tl.exp2(sink - m_i)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=i_mask[:, None] & d_mask[None, :])


def paged_extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 page_table: torch.Tensor, rows: torch.Tensor, cu_q_lens: torch.Tensor,
                 prefix_lens: torch.Tensor, max_q_len: int, sm_scale: float,
                 out: torch.Tensor | None = None, block_m: int | None = None,
                 block_n: int | None = None, window: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] packed by request -> [T, H, D]. rows, prefix_lens [B]; cu_q_lens [B + 1]
    (int32); max_q_len: the longest request's new tokens (a host int: it sizes the grid).
    `window`: a sliding-window layer's window in tokens; `sinks` [H]: attention-sink logits."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    batch = rows.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or batch == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    if block_m is None:
        block_m = 64 if max_q_len > 32 else 16
    if block_n is None:
        block_n = 64 if block_d <= 64 else 32
    grid = (batch, num_heads, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, rows, cu_q_lens, prefix_lens,
        q if sinks is None else sinks, sm_scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        page_table.stride(0),
        PAGE_SIZE=page_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WINDOW=window or 0, HAS_SINKS=sinks is not None, num_warps=4, num_stages=2,
    )
    return out
