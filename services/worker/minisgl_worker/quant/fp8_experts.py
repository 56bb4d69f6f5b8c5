"""Block-scaled fp8 MoE experts (Qwen3-30B-A3B-FP8, DeepSeek-V3): the stacked layout they are
held in and their reference product (fp32 torch: the CPU path with kept fp8 weights and the
oracle of kernels/moe_fp8_block.py).

The checkpoint gives each expert projection W [N, K] in e4m3 with one fp32 scale per 128x128
block, [ceil(N/128), ceil(K/128)]. The experts are stacked as layers/moe.py holds them:

    w13        fp8 [E, 2 * I, H]       gate rows, then up rows (this rank's I of each)
    w13_scale  fp32 [E, 2 * ceil(I/128), ceil(H/128)]   gate's block rows, then up's
    w2         fp8 [E, H, I]
    w2_scale   fp32 [E, ceil(H/128), ceil(I/128)]

Scales stay per block (not expanded per row as the dense layers hold them): gate and up keep
their own block rows, so up's first row starts a block row even where I is not a multiple of 128
(a tiny or TP=1 model), and a TP rank's share of I is a whole number of blocks (down_proj's input
features are cut there: prequant loading refuses a TP size that would cut a block). A kernel tile
row n then reads block row n // 128 of its part.

The product, as for dense block-scaled layers (fp8_block.py), with x quantized per token and
128-wide group (s = max|x_g| / 448) before each GEMM:
    h = silu(x W_gate^T) * (x W_up^T)   (rounded to the activation dtype, as the kernels store it)
    y = h W_down^T
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fp8_block import GROUP, expand_groups, groups, quantize_groups


def row_scales(blocks: torch.Tensor, rows: int, parts: int) -> torch.Tensor:
    """One expert's block scales [parts * ceil(rows/parts/128), KB] -> per row [rows, KB]."""
    per_part = rows // parts
    chunks = blocks.float().chunk(parts, dim=0)
    return torch.cat([c.repeat_interleave(GROUP, dim=0)[:per_part] for c in chunks])


def dequantize_expert(w: torch.Tensor, blocks: torch.Tensor, parts: int) -> torch.Tensor:
    """One expert's fp8 w [N, K] with its block scales -> fp32 [N, K]; parts: 2 for gate|up."""
    return w.float() * expand_groups(row_scales(blocks, w.shape[0], parts), w.shape[1])


def check_block_scales(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                       w2_scale: torch.Tensor) -> None:
    e, two_i, h = w13.shape
    inter = two_i // 2
    want = {"w13_scale": (e, 2 * groups(inter), groups(h)), "w2_scale": (e, groups(h), groups(inter))}
    for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if tuple(scale.shape) != want[name] or scale.dtype != torch.float32:
            raise ValueError(f"block-scaled experts: {name} must be fp32 {want[name]}, got "
                             f"{scale.dtype} {tuple(scale.shape)}")
    if tuple(w2.shape) != (e, h, inter):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} disagree")


def _block_product(x: torch.Tensor, w: torch.Tensor, blocks: torch.Tensor,
                   parts: int) -> torch.Tensor:
    qx, sx = quantize_groups(x)
    return (qx.float() * expand_groups(sx, x.shape[1])) @ dequantize_expert(w, blocks, parts).t()


def moe_block_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        w13_scale: torch.Tensor, w2_scale: torch.Tensor) -> torch.Tensor:
    """[T, H] in hidden's dtype: the block-scaled experts' formula one expert at a time, fp32
    products, the routing-weighted sum over k in fp32."""
    check_block_scales(w13, w2, w13_scale, w2_scale)
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        gate, up = _block_product(hidden[token], w13[e], w13_scale[e], 2).split(inter, -1)
        act = (F.silu(gate) * up).to(hidden.dtype)
        y = _block_product(act, w2[e], w2_scale[e], 1)
        out.index_add_(0, token, y * topk_weights[token, slot, None].float())
    return out.to(hidden.dtype)
