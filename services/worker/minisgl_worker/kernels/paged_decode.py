"""Paged decode attention, one query token per request, split-K (flash-decoding).

Stage 1: program (b, kv_head, split) runs an online softmax over its slice of the request's KV for
all query heads of that KV head (GQA heads share each K/V load), and leaves a normalised partial
output and its log-sum-exp (base 2). Stage 2: program (b, head) merges the splits. A split with no
tokens leaves lse = -inf and weighs nothing, so the split count can be fixed for a CUDA graph while
sequence lengths change; a row with seq_len 0 (a padded graph row) yields zeros.

Sliding-window layers (WINDOW > 0) read only the last WINDOW keys: the splits divide that range
(started at a block boundary, the keys before it masked), so a windowed layer's decode costs the
window, not the sequence. Attention sinks (a per-head logit in every softmax's denominator, no
value) enter once: in the output of a single split, or in the merge.

Two things keep an fp8 cache's loop near its (halved) byte count: the page ids of the next block
are loaded one iteration ahead, so the K/V loads never wait on the page-table load; and fp8 K/V
are upcast to fp16 (one conversion instruction, exact for both fp8 formats) with q in fp16 too,
instead of to bf16 (an H100, Qwen3-0.6B shape, B=256, ~1k contexts: 292 -> 256-260 us a layer;
a bf16 cache stays at ~390 us, the copy bandwidth; docs/benchmarks/log/2026-11-23-05.md).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import begin as _pdl_begin

_LOG2E = 1.4426950408889634
LOG2E: tl.constexpr = tl.constexpr(_LOG2E)  # for the kernels (a global they may read)
# Stage-1 programs (batch x KV heads x splits) worth launching: splits = the largest power of two
# <= _TARGET_PROGRAMS / (batch x KV heads), so one split (the kernel writes the output itself: no
# fp32 partials, no merge launch) from 512 programs on. Fitted on an H100 with the programs
# started longest request first (bench.micro.decode_splits --order longest, contexts
# 100-2,048, docs/benchmarks/log/2026-11-27-longest-first.md), bf16 and fp8 caches alike:
# one split beat two at 512-2,048 programs, two beat one at 256. (Started in batch order, long
# requests starting last set the kernel's end and splitting paid off sooner.)
_TARGET_PROGRAMS = 512
_MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32


@triton.jit
def _first_block(seq_len, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """The first KV position a request's splits cover: 0, or for a window the block holding the
    first key the query sees."""
    if WINDOW > 0:
        return (tl.maximum(seq_len - WINDOW, 0) // BLOCK_N) * BLOCK_N
    return seq_len * 0


@triton.jit
def _split_tokens(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """KV tokens a split covers: the request's tokens over the splits, in whole blocks. A split
    count sized for max_model_len (CUDA graphs) leaves the splits past a short request's KV
    empty; those write no partials and the merge reads only the cdiv(seq_len, this) that hold
    tokens (batch 1, 4 KV heads, 366 tokens on an H100: 32 splits took 7.0 us a layer when the
    empty ones stored and were merged, 6.7 since; 8 splits 5.3-5.6)."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


# stride_pt: eager decode steps ship page tables as wide as the batch's widest row; see
# paged_extend's kernel.
@triton.jit(do_not_specialize=["stride_pt"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, rows_ptr, seq_lens_ptr, order_ptr, part_o_ptr,
    part_lse_ptr, out_ptr, sinks_ptr, qk_scale, num_splits,
    stride_qb, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_pt,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_outb, stride_outh,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, MMA_FP16: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    DIRECT: tl.constexpr = False, ORDERED: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    WINDOW: tl.constexpr = 0, HAS_SINKS: tl.constexpr = False,
):
    _pdl_begin(USE_PDL)
    # Programs start in grid order: every KV head of a request, request after request, in
    # `order` (longest first) when given, so that the longest ones do not start last.
    i = tl.program_id(0) // NUM_KV_HEADS
    kvh = tl.program_id(0) % NUM_KV_HEADS
    split = tl.program_id(1)
    b = tl.load(order_ptr + i) if ORDERED else i
    seq_len = tl.load(seq_lens_ptr + b)
    row = tl.load(rows_ptr + b).to(tl.int64)
    first = _first_block(seq_len, WINDOW, BLOCK_N)
    per_split = _split_tokens(seq_len - first, num_splits, BLOCK_N)
    start = first + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    lowest = tl.maximum(seq_len - WINDOW, 0) if WINDOW > 0 else 0  # the first key seen

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if MMA_FP16:  # fp8 K/V: products in fp16 (q clamped to its range; never reached in practice)
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    table_row = page_table_ptr + row * stride_pt
    # Blocks start at multiples of BLOCK_N; when pages are whole multiples of it, a block lies
    # in one page: one page id a block, and K/V addresses the compiler sees as contiguous rows.
    WHOLE_PAGES: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
    if WHOLE_PAGES:
        next_page = tl.load(table_row + start // PAGE_SIZE, mask=start < end, other=0)
    else:
        next_page = tl.load(table_row + (start + n) // PAGE_SIZE, mask=start + n < end, other=0)
    for s in range(start, end, BLOCK_N):
        t = s + n
        t_mask = t < end
        seen = t_mask & (t >= lowest) if WINDOW > 0 else t_mask
        off = t % PAGE_SIZE
        if WHOLE_PAGES:
            kv_base = next_page.to(tl.int64) * stride_kp + off[:, None] * stride_kt
            vv_base = next_page.to(tl.int64) * stride_vp + off[:, None] * stride_vt
            next_page = tl.load(table_row + (s + BLOCK_N) // PAGE_SIZE, mask=s + BLOCK_N < end,
                                other=0)
        else:
            page = next_page.to(tl.int64)
            kv_base = page[:, None] * stride_kp + off[:, None] * stride_kt
            vv_base = page[:, None] * stride_vp + off[:, None] * stride_vt
            t_next = t + BLOCK_N
            next_page = tl.load(table_row + t_next // PAGE_SIZE, mask=t_next < end, other=0)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_base + kvh * stride_kh + d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        qk = tl.where(seen[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + vv_base + kvh * stride_vh + d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    has = l_i > 0
    if DIRECT and HAS_SINKS:  # the sink joins the one split's denominator (base-2 logits)
        sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * LOG2E
        l_i = l_i + tl.exp2(sink - m_i)
        has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT:  # one split: this is the answer, no partials and no merge
        tl.store(out_ptr + b.to(tl.int64) * stride_outb + heads[:, None] * stride_outh
                 + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])
    elif start < seq_len:  # a split past the KV stores nothing: the merge never reads it
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        o_off = (b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os
                 + d[None, :])
        tl.store(part_o_ptr + o_off, out, mask=g_mask[:, None] & d_mask[None, :])
        tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, seq_lens_ptr, sinks_ptr, num_splits,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False, WINDOW: tl.constexpr = 0,
    HAS_SINKS: tl.constexpr = False,
):
    _pdl_begin(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    seq_len = tl.load(seq_lens_ptr + b)
    span = seq_len - _first_block(seq_len, WINDOW, BLOCK_N)
    s_mask = s * _split_tokens(span, num_splits, BLOCK_N) < span  # the splits with KV
    d_mask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + s, mask=s_mask,
                  other=float("-inf"))
    top = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * LOG2E
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    o = tl.load(part_o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
                + s[:, None] * stride_os + d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    if HAS_SINKS:  # a split of its own with no value: only the denominator grows
        total += tl.exp2(sink - top)
    out = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_outb + h * stride_outh + d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


_BLOCK_N = 64  # KV tokens per loop step


@functools.cache
def _default_stages(device: torch.device, row_bytes: int) -> int:
    """Pipeline stages of the K/V loads: 3 where three K and V tiles fit in shared memory with
    room to spare (Hopper, Ampere A100), else 2."""
    if device.type != "cuda":
        return 2
    props = torch.cuda.get_device_properties(device)
    # torch's stubs miss this attribute of the CUDA device properties.
    smem = props.shared_memory_per_block_optin  # type: ignore[attr-defined]
    return 3 if 3 * 2 * _BLOCK_N * row_bytes <= smem * 3 // 4 else 2


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Enough splits to fill the GPU when the batch is small, never slices under a few hundred
    tokens; a power of two so that few variants get compiled. The same for any cache dtype."""
    want = max(1, _TARGET_PROGRAMS // max(1, batch * num_kv_heads))
    want = min(want, triton.cdiv(max(1, max_seq_len), _MIN_SPLIT_TOKENS), MAX_SPLITS)
    return 1 << (want.bit_length() - 1)  # the largest power of two <= want


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 page_table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                 sm_scale: float, num_splits: int, out: torch.Tensor | None = None,
                 block_n: int = _BLOCK_N,
                 workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                 num_warps: int = 4, num_stages: int | None = None,
                 order: torch.Tensor | None = None, window: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]. rows [B]: page-table row of each request; seq_lens [B] int32:
    KV tokens (the current token's K/V already stored). `workspace` (partial outputs
    [B, H, S, D] fp32, lse [B, H, S] fp32) may be preallocated for CUDA graphs. `order` [B]
    int32, a permutation of 0..B-1: the requests in the order their programs start (longest
    first shortens the kernel's tail); None: 0..B-1. `window`: a sliding-window layer's window
    in tokens; `sinks` [H]: attention-sink logits."""
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if workspace is None:  # (one split writes `out` directly; the partials stay unwritten)
        part_o = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_o, part_lse = workspace[0][:batch], workspace[1][:batch]
    block_d = triton.next_power_of_2(head_dim)
    if num_stages is None:
        num_stages = _default_stages(q.device, k_cache.element_size() * block_d)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    launch = pdl.options(q)
    mma_fp16 = k_cache.element_size() == 1 and q.dtype in (torch.bfloat16, torch.float16)
    direct = num_splits == 1
    _decode_split_kernel[(batch * num_kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, rows, seq_lens, rows if order is None else order,
        part_o, part_lse, out, q if sinks is None else sinks,
        sm_scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        PAGE_SIZE=page_size, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        PRECISION=precision, MMA_FP16=mma_fp16, NUM_KV_HEADS=num_kv_heads, DIRECT=direct,
        ORDERED=order is not None, num_warps=num_warps,
        num_stages=num_stages, WINDOW=window or 0, HAS_SINKS=sinks is not None, **launch,
    )
    if direct:
        return out
    _decode_merge_kernel[(batch, num_heads)](
        part_o, part_lse, out, seq_lens, q if sinks is None else sinks, num_splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        BLOCK_N=block_n, num_warps=4, WINDOW=window or 0, HAS_SINKS=sinks is not None,
        **launch,
    )
    return out
