"""4-bit MoE experts (Qwen3-MoE / DeepSeek per-expert tensors `mlp.experts.{e}.gate_proj.qweight`
...) stacked on their SparseMoeBlock in the W4A16 layout (quant/w4a16.W4Experts):

    w13_qweight int32 [E, H/8, 2 I_local]  gate columns, then up (W13 [2I, H] as [K=H, N=2I])
    w13_scales, w13_zeros [E, H/G, 2 I_local]
    w2_qweight int32 [E, I_local/8, H], w2_scales, w2_zeros [E, I_local/G, H]

TP splits I like the dense MLP: w13's N (whole int32s where N is packed), w2's K (whole groups).
Act-order experts (a g_idx other than k // G) are refused: a grouped expert GEMM has no per-expert
row order. After loading: a CUDA fp16/bf16 model keeps them packed and its experts_fn runs
kernels/moe_w4a16.py; elsewhere they are dequantized into the block's plain w13 / w2 and the
default experts function runs them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..distributed import tp
from ..kernels.fused_moe import fused_moe, moe_reference
from ..layers.deepseek_moe import DeepseekMoeBlock
from ..layers.moe import ExpertsFn, SparseMoeBlock
from ..layers.weights import WeightSource, set_loader
from ..quant.w4_config import W4Format
from ..quant.w4a16 import PACK, SYMMETRIC_ZERO, W4Experts, W4Weight, dequantize
from . import w4_layouts as lay

BLOCKS = (SparseMoeBlock, DeepseekMoeBlock)  # per-expert checkpoint tensors, SwiGLU, no biases
ATTRS = ("qweight", "scales", "zeros")


def _refuse(cond: bool, name: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {what} (tp_size={tp().size}); refusing to load it")


def convert_experts(block: SparseMoeBlock, name: str, fmt: W4Format,
                    parts: dict[str, set[str]]) -> None:
    """Replace the block's w13 / w2 by packed parameters (both must be packed)."""
    _refuse(set(parts) == {"w13", "w2"}, name, f"only {sorted(parts)} of its experts are 4-bit")
    _refuse(not fmt.act_order, name, "act-order (g_idx) experts are not supported")
    h, inter, n, e = block.hidden_size, block.inter, block.inter_local, block.num_experts
    rank = tp().rank
    dtype, device = block.w13.dtype, block.w13.device
    g_h = h if fmt.group_size == -1 else fmt.group_size
    g_i = inter if fmt.group_size == -1 else fmt.group_size
    _refuse(h % g_h == 0 and h % PACK == 0, name, f"hidden size {h} is not whole groups of {g_h}")
    packs_n = any(a in parts["w13"] for a in lay.N_PACKED[fmt.layout])
    _refuse(not packs_n or n % PACK == 0, name, f"moe_intermediate_size {inter} split into {n} "
            f"per rank, not whole int32s of {PACK} packed 4-bit values")
    if fmt.group_size == -1:
        _refuse(n % PACK == 0, name, f"moe_intermediate_size {inter} split into {n} per rank, "
                f"not whole int32s of {PACK}")
        w2_part, w2_group = lay.Part(h, inter, 0, h, rank * n, n, inter, 0, 1), n
    else:
        _refuse(n % g_i == 0, name, f"moe_intermediate_size {inter} split into {n} per rank, "
                f"cutting a {g_i}-wide quantization group")
        w2_part, w2_group = lay.Part(h, inter, 0, h, rank * n, n, g_i, rank * n // g_i,
                                     n // g_i), g_i
    w13_part = lay.Part(inter, h, rank * n, n, 0, h, g_h, 0, h // g_h)
    setattr(block, "w4_groups", {"w13": g_h, "w2": w2_group})  # noqa: B010 - not a declared field
    for which, p, cols, shards in (("w13", w13_part, 2 * n, 2 * e), ("w2", w2_part, h, e)):
        shapes = {"qweight": (p.k // PACK, cols), "scales": (p.g, cols), "zeros": (p.g, cols),
                  "g_idx": (0,), "shape": (0,)}
        for attr in parts[which]:
            dt = torch.int32 if attr in ("qweight", "g_idx", "shape") else dtype
            lead = (e,) if attr in ATTRS else ()
            t = torch.zeros(*lead, *shapes[attr], dtype=dt, device=device)
            param = set_loader(nn.Parameter(t, requires_grad=False),
                               _loader(fmt, attr, p, name), shards)
            setattr(block, f"{which}_{attr}", param)
        block.register_parameter(which, None)


def _loader(fmt: W4Format, attr: str, p: lay.Part, name: str) -> Any:
    def load(param: nn.Parameter, src: WeightSource, shard_id: tuple[int, int]) -> None:
        expert, which = shard_id
        if attr == "g_idx":
            got = lay.g_idx(src, p)
            want = torch.arange(p.k0, p.k0 + p.k, device=got.device) // p.group
            _refuse(torch.equal(got, want), name,
                    f"expert {expert}'s g_idx is act-order; act-order experts are not supported")
            return
        if attr == "shape":
            lay.check_weight_shape(src, p)
            return
        if attr == "qweight":
            part = lay.qweight(fmt.layout, src, p)
        elif attr == "scales":
            part = lay.scales(fmt.layout, src, p)
        else:
            part = lay.zeros(fmt.layout, src, p, fmt.zero_offset)
        param.data[expert].narrow(1, which * p.n, p.n).copy_(part)
    return load


def is_packed(block: SparseMoeBlock) -> bool:
    return getattr(block, "w13_qweight", None) is not None


def experts(block: nn.Module, which: str) -> W4Experts:
    groups = getattr(block, "w4_groups")  # noqa: B009 - set by convert_experts, undeclared
    return W4Experts(getattr(block, f"{which}_qweight"), getattr(block, f"{which}_scales"),
                     getattr(block, f"{which}_zeros", None), groups[which])


def _dequantize(w: W4Experts) -> torch.Tensor:
    """[E, N, K] in fp32."""
    return torch.stack([dequantize(W4Weight(w.qweight[e], w.scales[e],
                                            None if w.zeros is None else w.zeros[e],
                                            w.group_size)) for e in range(w.qweight.shape[0])])


def _experts_fn(block: SparseMoeBlock) -> ExpertsFn:
    def run(hidden: torch.Tensor, w13: object, w2: object, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor, **_: object) -> torch.Tensor:
        a, b = experts(block, "w13"), experts(block, "w2")
        if hidden.is_cuda:
            from ..kernels.moe_w4a16 import fused_moe_w4a16  # imports triton

            return fused_moe_w4a16(hidden, a, b, topk_ids, topk_weights)
        dt = hidden.dtype  # the packed form on CPU: the reference (tests)
        return moe_reference(hidden, _dequantize(a).to(dt), _dequantize(b).to(dt), topk_ids,
                             topk_weights)
    return run


def finish(block: SparseMoeBlock, keep: bool, dtype: torch.dtype) -> None:
    """Drop all-8 zero points and load-only tensors; then keep packed (experts_fn on the W4
    kernels) or dequantize into plain w13 / w2."""
    for which in ("w13", "w2"):
        zeros = getattr(block, f"{which}_zeros", None)
        if zeros is not None and bool((zeros == SYMMETRIC_ZERO).all()):
            delattr(block, f"{which}_zeros")
        for attr in ("g_idx", "shape"):
            if hasattr(block, f"{which}_{attr}"):
                delattr(block, f"{which}_{attr}")
    if keep:
        block.experts_fn = _experts_fn(block)
        return
    for which in ("w13", "w2"):
        w = _dequantize(experts(block, which)).to(dtype)
        for attr in ATTRS:
            if hasattr(block, f"{which}_{attr}"):
                delattr(block, f"{which}_{attr}")
        setattr(block, which, nn.Parameter(w, requires_grad=False))
    block.experts_fn = fused_moe
