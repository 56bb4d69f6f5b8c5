"""Paged attention for multi-head latent attention (DeepSeek MLA) in its absorbed form.

Every query head attends to one shared cached row a token: the latent (the first V_DIM values,
which are also the values) followed by the rotary key (ROPE_DIM values). So one K row load
serves all heads, and V is that same load's latent part: nothing else is read. The row is loaded
as its two parts, each padded to a power of two (DeepSeek's 512 + 64 need no padding), and each
program takes a block of heads (decode) or of queries of one head (extend).

Decode (split-K like paged_decode): program (b, head block, split) leaves a normalised partial
output and its base-2 log-sum-exp; paged_decode's merge kernel combines the splits (the same
split arithmetic), or one split writes the output itself. Extend: program (b, head, query block)
over the request's cached prefix and, causally, its new tokens (paged_extend's semantics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_decode import _decode_merge_kernel, _split_tokens

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["stride_pt"])
def _mla_decode_kernel(
    q_ptr, kv_ptr, page_table_ptr, rows_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr, out_ptr,
    qk_scale, num_splits, num_heads,
    stride_qb, stride_qh, stride_kp, stride_kt, stride_pt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    PAGE_SIZE: tl.constexpr, V_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_mask = heads < num_heads
    seq_len = tl.load(seq_lens_ptr + b)
    row = tl.load(rows_ptr + b).to(tl.int64)
    per_split = _split_tokens(seq_len, num_splits, BLOCK_N)
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    dv = tl.arange(0, BLOCK_V)
    dr = tl.arange(0, BLOCK_R)
    v_mask = dv < V_DIM
    r_mask = dr < ROPE_DIM
    q_row = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + dv[None, :], mask=h_mask[:, None] & v_mask[None, :], other=0.0)
    q_pe = tl.load(q_row + V_DIM + dr[None, :], mask=h_mask[:, None] & r_mask[None, :],
                   other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for s in range(start, end, BLOCK_N):
        t = s + n
        t_mask = t < end
        page = tl.load(page_table_ptr + row * stride_pt + t // PAGE_SIZE, mask=t_mask, other=0)
        base = kv_ptr + page.to(tl.int64)[:, None] * stride_kp + (t % PAGE_SIZE)[:, None] * stride_kt
        k_lat = tl.load(base + dv[None, :], mask=t_mask[:, None] & v_mask[None, :],
                        other=0.0).to(q_lat.dtype)
        k_pe = tl.load(base + V_DIM + dr[None, :], mask=t_mask[:, None] & r_mask[None, :],
                       other=0.0).to(q_pe.dtype)
        qk = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
        qk += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
        qk = tl.where(t_mask[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat, input_precision=PRECISION)
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT:
        tl.store(out_ptr + b.to(tl.int64) * stride_outb + heads[:, None] * stride_outh
                 + dv[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=h_mask[:, None] & v_mask[None, :])
    elif start < seq_len:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
                 + split * stride_os + dv[None, :], out, mask=h_mask[:, None] & v_mask[None, :])
        tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit(do_not_specialize=["stride_pt"])
def _mla_extend_kernel(
    q_ptr, kv_ptr, out_ptr, page_table_ptr, rows_ptr, cu_q_ptr, prefix_ptr, qk_scale,
    stride_qt, stride_qh, stride_kp, stride_kt, stride_ot, stride_oh, stride_pt,
    PAGE_SIZE: tl.constexpr, V_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
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
    i = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    i_mask = i < q_len
    tok = (q_start + i).to(tl.int64)
    dv = tl.arange(0, BLOCK_V)
    dr = tl.arange(0, BLOCK_R)
    v_mask = dv < V_DIM
    r_mask = dr < ROPE_DIM
    q_row = q_ptr + tok[:, None] * stride_qt + h * stride_qh
    q_lat = tl.load(q_row + dv[None, :], mask=i_mask[:, None] & v_mask[None, :], other=0.0)
    q_pe = tl.load(q_row + V_DIM + dr[None, :], mask=i_mask[:, None] & r_mask[None, :],
                   other=0.0)
    q_pos = prefix + i

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    kv_end = prefix + tl.minimum(q_len, (mb + 1) * BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    for s in range(0, kv_end, BLOCK_N):
        t = s + n
        t_mask = t < kv_end
        page = tl.load(page_table_ptr + row * stride_pt + t // PAGE_SIZE, mask=t_mask, other=0)
        base = kv_ptr + page.to(tl.int64)[:, None] * stride_kp + (t % PAGE_SIZE)[:, None] * stride_kt
        k_lat = tl.load(base + dv[None, :], mask=t_mask[:, None] & v_mask[None, :],
                        other=0.0).to(q_lat.dtype)
        k_pe = tl.load(base + V_DIM + dr[None, :], mask=t_mask[:, None] & r_mask[None, :],
                       other=0.0).to(q_pe.dtype)
        qk = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
        qk += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
        visible = t_mask[None, :] & (t[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=i_mask[:, None] & v_mask[None, :])


def _check(q: torch.Tensor, kv_cache: torch.Tensor, v_dim: int) -> dict[str, int]:
    """The kernels' shape constants: page size, the two parts' widths and their blocks."""
    _, page_size, kv_heads, width = kv_cache.shape
    rope = width - v_dim
    if kv_heads != 1 or q.shape[-1] != width or not 0 < v_dim < width:
        raise ValueError(f"MLA attention takes one cached row a token of q's width, values its "
                         f"first {v_dim}; got cache {tuple(kv_cache.shape)} for q "
                         f"{tuple(q.shape)}")
    return dict(PAGE_SIZE=page_size, V_DIM=v_dim, ROPE_DIM=rope,
                BLOCK_V=max(16, triton.next_power_of_2(v_dim)),
                BLOCK_R=max(16, triton.next_power_of_2(rope)))


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, v_dim: int, page_table: torch.Tensor,
               rows: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, num_splits: int,
               workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
               block_n: int = 32, block_h: int = 16, num_warps: int = 4,
               num_stages: int = 3) -> torch.Tensor:
    """q [B, H, V + R] -> [B, H, V]. kv_cache [P, page_size, 1, V + R] (latent, then rotary key);
    rows / seq_lens as paged_decode. `workspace` (partials [B, H, S, V], lse [B, H, S] fp32)
    may be preallocated for CUDA graphs."""
    batch, num_heads, _ = q.shape
    shape = _check(q, kv_cache, v_dim)
    vd = v_dim
    out = q.new_empty(batch, num_heads, vd)
    if batch == 0:
        return out
    if workspace is None:
        part_o = torch.empty(batch, num_heads, num_splits, vd, dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_o, part_lse = workspace[0][:batch], workspace[1][:batch]
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    direct = num_splits == 1
    _mla_decode_kernel[(batch, triton.cdiv(num_heads, block_h), num_splits)](
        q, kv_cache, page_table, rows, seq_lens, part_o, part_lse, out,
        sm_scale * _LOG2E, num_splits, num_heads,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), page_table.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0),
        part_lse.stride(1), out.stride(0), out.stride(1),
        **shape, BLOCK_H=block_h, BLOCK_N=block_n, PRECISION=precision, DIRECT=direct,
        num_warps=num_warps, num_stages=num_stages,
    )
    if direct:
        return out
    _decode_merge_kernel[(batch, num_heads)](
        part_o, part_lse, out, seq_lens, q, num_splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=vd, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=shape["BLOCK_V"],
        BLOCK_N=block_n,
        num_warps=4,
    )
    return out


def mla_extend(q: torch.Tensor, kv_cache: torch.Tensor, v_dim: int, page_table: torch.Tensor,
               rows: torch.Tensor, cu_q_lens: torch.Tensor, prefix_lens: torch.Tensor,
               max_q_len: int, sm_scale: float, block_m: int | None = None,
               block_n: int = 32) -> torch.Tensor:
    """q [T, H, V + R] packed by request -> [T, H, V]; arguments as paged_extend's."""
    num_tokens, num_heads, _ = q.shape
    shape = _check(q, kv_cache, v_dim)
    out = q.new_empty(num_tokens, num_heads, v_dim)
    batch = rows.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    if block_m is None:
        block_m = 32 if max_q_len > 16 else 16
    _mla_extend_kernel[(batch, num_heads, triton.cdiv(max_q_len, block_m))](
        q, kv_cache, out, page_table, rows, cu_q_lens, prefix_lens, sm_scale * _LOG2E,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), out.stride(0),
        out.stride(1), page_table.stride(0),
        **shape, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=8, num_stages=2,
    )
    return out
