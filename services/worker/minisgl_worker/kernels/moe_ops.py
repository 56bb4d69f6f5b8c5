"""The two small kernels around the MoE GEMMs: the router's top-k and the sum over the k experts.

Both replaced chains of torch ops that cost more than their bytes (Qwen3-30B-A3B offline on one
H200, torch profiler: softmax, topk's gather and sort, the renormalising sum and division and
the casts took ~1.1 s of a 24 s run, ~22 us a layer a step; the bf16 sum over k 7.7 us a call
for 8 MB; docs/benchmarks/log/2026-11-26-moe.md).

route_topk: one program per block of tokens loads its router logits once, takes the softmax in
fp32 (as HF does), picks the k largest probabilities by k rounds of argmax (ties to the lower
expert id), optionally renormalises them and writes weights in the logits' dtype and int64 ids,
the output of `fused_moe.route`'s torch formula.

sum_over_k: [T, K, H] -> [T, H], accumulated in fp32 in k order and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import begin as _pdl_begin


@triton.jit
def _route_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts,
    stride_l, stride_w, stride_i,
    TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    _pdl_begin(USE_PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    kk = tl.arange(0, BLOCK_K)
    t_mask = t < num_tokens
    e_mask = e < num_experts
    x = tl.load(logits_ptr + t[:, None].to(tl.int64) * stride_l + e[None, :],
                mask=t_mask[:, None] & e_mask[None, :], other=0.0).to(tl.float32)
    x = tl.where(e_mask[None, :], x, float("-inf"))
    m = tl.max(x, axis=1)
    p = tl.exp(x - m[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    p = tl.where(e_mask[None, :], p, -1.0)  # probabilities are >= 0: padding never wins
    vals = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    idxs = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        # the lowest expert id holding the maximum
        pick = tl.min(tl.where(p == best[:, None], e[None, :], BLOCK_E), axis=1)
        pick = tl.minimum(pick, num_experts - 1)  # NaN logits match nothing: stay in range
        vals = tl.where(kk[None, :] == k, best[:, None], vals)
        idxs = tl.where(kk[None, :] == k, pick[:, None], idxs)
        p = tl.where(e[None, :] == pick[:, None], -1.0, p)
    if NORM:
        vals = vals / tl.sum(vals, axis=1)[:, None]
    out_mask = t_mask[:, None] & (kk[None, :] < TOP_K)
    row = t[:, None].to(tl.int64)
    tl.store(weights_ptr + row * stride_w + kk[None, :],
             vals.to(weights_ptr.dtype.element_ty), mask=out_mask)
    tl.store(ids_ptr + row * stride_i + kk[None, :], idxs.to(tl.int64), mask=out_mask)


def route_topk(router_logits: torch.Tensor, top_k: int,
               norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, K] in the logits' dtype, ids [T, K] int64), one launch.
    The caller checks the shapes (fused_moe.route)."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=router_logits.dtype,
                          device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(16, 4096 // block_e))  # ~4k fp32 values a program
    _route_topk_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, weights, ids, num_tokens, num_experts,
        logits.stride(0), weights.stride(0), ids.stride(0),
        TOP_K=top_k, NORM=norm_topk_prob, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=4, **pdl.options(logits))
    return weights, ids


@triton.jit
def _sum_over_k_kernel(x_ptr, out_ptr, hidden, stride_xt, stride_xk, stride_ot,
                       TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    _pdl_begin(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = h < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + t * stride_xt + k * stride_xk + h, mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + h, acc.to(out_ptr.dtype.element_ty), mask=mask)


_SUM_BLOCK_H = 1024


def sum_over_k(per_pair: torch.Tensor) -> torch.Tensor:
    """[T, K, H] (H contiguous) -> [T, H] in the same dtype."""
    num_tokens, top_k, hidden = per_pair.shape
    out = per_pair.new_empty(num_tokens, hidden)
    if num_tokens == 0:
        return out
    block_h = min(_SUM_BLOCK_H, triton.next_power_of_2(hidden))
    _sum_over_k_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        per_pair, out, hidden, per_pair.stride(0), per_pair.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_H=block_h, num_warps=4, **pdl.options(per_pair))
    return out
