"""Fused MoE with W4A16 experts (quant/w4a16.py's W4Experts), the bf16 path of fused_moe.py with
the expert weights dequantized in registers:

1. align: fused_moe.align_pairs groups the (token, k) pairs by expert, padded to BLOCK_M;
2. one grouped GEMM for gate and up of every expert, SiLU-and-mul in its epilogue, [pairs, I];
3. one grouped GEMM for down scaled by the routing weight into [T, K, H], then moe_ops.sum_over_k.
Grids are sized for the worst case on the host, nothing is read back: CUDA-graph safe.

    out[t] = sum_k w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, k]
"""

from __future__ import annotations

import torch

from ..quant.w4a16 import W4Experts, dequantize_experts
from .fused_moe import Alignment, GemmTile, MoeConfig, align_pairs, moe_reference


def choose_config(num_tokens: int) -> MoeConfig:
    """Tiles by batch size for Qwen3-30B-A3B-like shapes (E=128, H=2048, I=768, top-8) on an
    H200: first guesses from the bf16 table's shape (a W4 tile moves a quarter of the bytes,
    so the decode tiles are deeper in K); the gate_up tiles at 1-32 and 129-512 tokens from
    tests/gpu/test_w4a16.py --sweep (1 token: 128 -> 90 us, 256: 692 -> 465 us). BLOCK_K >= 32."""
    if num_tokens <= 32:  # ~1-2 rows an expert: memory-bound, narrow tiles, many programs
        return MoeConfig(16, GemmTile(32, 256, 4, 3), GemmTile(64, 128, 4, 4))
    if num_tokens <= 128:
        return MoeConfig(16, GemmTile(64, 128, 4, 4), GemmTile(128, 128, 4, 4))
    if num_tokens <= 512:
        return MoeConfig(32, GemmTile(128, 64, 4, 4), GemmTile(128, 64, 4, 4))
    if num_tokens <= 2048:
        return MoeConfig(64, GemmTile(128, 64, 8, 3), GemmTile(128, 64, 8, 3))
    return MoeConfig(128, GemmTile(128, 64, 8, 3), GemmTile(128, 64, 8, 3))


def _check(hidden: torch.Tensor, w13: W4Experts, w2: W4Experts, topk_ids: torch.Tensor,
           topk_weights: torch.Tensor) -> None:
    if hidden.dim() != 2 or hidden.shape[1] != w13.in_features:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match w13's K={w13.in_features}")
    inter = w13.out_features // 2
    if (w13.out_features % 2 or w2.in_features != inter or w2.out_features != hidden.shape[1]
            or w2.num_experts != w13.num_experts):
        raise ValueError(f"expert shapes disagree: w13 K={w13.in_features} N={w13.out_features},"
                         f" w2 K={w2.in_features} N={w2.out_features}")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or (
            topk_ids.shape[0] != hidden.shape[0]):
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={hidden.shape[0]}, K]")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.zeros is not None and w.zeros.stride() != w.scales.stride():
            raise ValueError(f"{name}: zeros and scales must share one layout")
        if w.in_features % w.group_size or w.group_size % 8:
            raise ValueError(f"{name}: group size {w.group_size} does not tile K={w.in_features}")


def moe_w4a16_reference(hidden: torch.Tensor, w13: W4Experts, w2: W4Experts,
                        topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Dequantize the experts to hidden's dtype, then fused_moe.moe_reference (the oracle)."""
    _check(hidden, w13, w2, topk_ids, topk_weights)
    return moe_reference(hidden, dequantize_experts(w13).to(hidden.dtype),
                         dequantize_experts(w2).to(hidden.dtype), topk_ids, topk_weights)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _launch(a: torch.Tensor, w: W4Experts, out: torch.Tensor, weights: torch.Tensor,
            al: Alignment, num_pairs: int, n_out: int, tile: GemmTile, block_m: int,
            a_div: int, gate_up: bool) -> None:
    from . import pdl
    from .moe_w4a16_kernels import moe_w4_kernel

    k = w.in_features
    zeros = w.zeros if w.zeros is not None else w.scales
    grid = (al.num_tiles_m * _cdiv(n_out, tile.block_n),)
    moe_w4_kernel[grid](
        a, w.qweight, w.scales, zeros, out, weights,
        al.sorted_pairs, al.expert_of_block, al.num_padded,
        num_pairs, n_out, k, al.num_tiles_m,
        a.stride(0), w.qweight.stride(0), w.qweight.stride(1), w.scales.stride(0),
        w.scales.stride(1), out.stride(0),
        G=w.group_size, HAS_ZEROS=w.zeros is not None, A_DIV=a_div, GATE_UP=gate_up,
        EVEN_K=k % tile.block_k == 0, EVEN_N=n_out % tile.block_n == 0, BLOCK_M=block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl.options(a))


def fused_moe_w4a16(hidden: torch.Tensor, w13: W4Experts, w2: W4Experts, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, config: MoeConfig | None = None) -> torch.Tensor:
    """[T, H] MoE output, the Triton path (CUDA, or CPU under TRITON_INTERPRET=1)."""
    from .moe_ops import sum_over_k

    _check(hidden, w13, w2, topk_ids, topk_weights)
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    inter = w13.out_features // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return hidden.new_zeros(hidden.shape)
    cfg = config or choose_config(num_tokens)
    hidden = hidden.contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    al = align_pairs(topk_ids, w13.num_experts, cfg.block_m)
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    _launch(hidden, w13, act, weights, al, num_pairs, inter, cfg.gate_up, cfg.block_m,
            a_div=top_k, gate_up=True)
    per_pair = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _launch(act, w2, per_pair, weights, al, num_pairs, hidden_size, cfg.down, cfg.block_m,
            a_div=1, gate_up=False)
    return sum_over_k(per_pair.view(num_tokens, top_k, hidden_size))
