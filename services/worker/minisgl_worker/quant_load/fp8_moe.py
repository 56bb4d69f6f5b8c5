"""Pre-quantized FP8 MoE experts (formats: prequant.py), loaded into the stacked expert parameters
of layers/moe.py (SparseMoeBlock, DeepSeek's block too): prequant_load calls `convert` before the
weights are read and `finalize` after.

A checkpoint stores each expert's projections apart, `mlp.experts.{e}.{gate,up,down}_proj.weight`
in e4m3 with their scales; the loader's (expert, part) shard ids place them:

  block    `weight_scale_inv` [ceil(N/128), ceil(K/128)]: held per block, w13_scale
           [E, 2*ceil(I/128), ceil(H/128)] and w2_scale [E, ceil(H/128), ceil(I/128)]
           (quant/fp8_experts.py), run by kernels/moe_fp8_block.py (activations quantized per
           token and 128-group). TP splits each expert's intermediate dimension I: a rank's
           share must be whole 128-blocks (down_proj's input features), else start-up refuses.
  channel  compressed-tensors `weight_scale` [N, 1] (or a per-tensor [1] / scalar, expanded to
  tensor   rows; quant_method fp8 without blocks): the per-row fp8 experts of `--quantization fp8`
           (w13_scale [E, 2I], w2_scale [E, H]; fused_moe's fp8 kernels, activations per row).

Static activation scales on experts are refused (the expert kernels quantize activations
dynamically). After loading, experts stay fp8 where the dense fp8 projections do (an fp8 GPU,
bf16 model); elsewhere they are dequantized into the model dtype and run as plain experts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..distributed import tp
from ..fp8 import FP8
from ..fp8_block import GROUP, groups
from ..kernels.fused_moe import fused_moe
from ..kernels.moe_fp8_block import BLOCK_FP8_EXPERTS
from ..layers.moe import SparseMoeBlock
from ..layers.weights import WeightSource, check_shape, read, set_loader, src_shape
from ..prequant import CheckpointQuant
from ..quant.fp8_experts import dequantize_expert
from . import fp8_mla

Target = tuple[str, Any]
_STACKS = (".w13", ".w2")


def is_experts(param: str) -> bool:
    """Whether a weight target is a stacked experts parameter (w13 / w2 of a MoE block)."""
    return param.endswith(_STACKS)


def scale_target(target: Target, attr: str) -> Target:
    """A scale tensor of an expert weight -> its stacked scale parameter, the weight's shard id.
    (input_scale names no parameter: the loader refuses it, convert says why first.)"""
    param, shard = target
    return (f"{param}_input_scale" if attr == "input_scale" else f"{param}_scale"), shard


def convert(mod: nn.Module, name: str, quant: CheckpointQuant) -> bool:
    """Turn a module the checkpoint stores in fp8 into fp8 parameters with scales, if it is one
    this module knows (MoE experts, DeepSeek's latent projections); False otherwise."""
    if isinstance(mod, SparseMoeBlock):
        _convert_experts(mod, name, quant)
        return True
    return fp8_mla.convert(mod, name, quant)


def _fp8_like(like: nn.Parameter) -> nn.Parameter:
    p = nn.Parameter(torch.empty(like.shape, dtype=FP8, device=like.device), requires_grad=False)
    return set_loader(p, like.weight_loader, like.num_shards)  # type: ignore[attr-defined]


def _scale_param(shape: tuple[int, ...], like: nn.Parameter, loader: Any) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=torch.float32, device=like.device),
                     requires_grad=False)
    return set_loader(p, loader, like.num_shards)  # type: ignore[attr-defined]


def _convert_experts(block: SparseMoeBlock, name: str, quant: CheckpointQuant) -> None:
    if quant.scheme not in ("block", "tensor", "channel"):
        raise ValueError(f"{name}: {quant.scheme} experts are not implemented")
    if getattr(block, "w13_bias", None) is not None:
        raise ValueError(f"{name}: fp8 experts with biases (gpt-oss) are not implemented")
    if quant.static_activations:
        raise ValueError(f"{name}: static activation scales (input_scale) on MoE experts are not "
                         "implemented (the expert kernels quantize activations per token)")
    e, two_n, h = block.w13.shape
    n = two_n // 2
    if quant.scheme == "block" and tp().size > 1 and n % GROUP:
        raise ValueError(
            f"tp_size={tp().size} splits {name}'s moe_intermediate_size {block.inter} into {n} "
            f"per rank, cutting a {GROUP}-wide fp8 scale block of the experts' down_proj "
            f"(block-quantized experts need moe_intermediate_size / tp_size divisible by {GROUP})")
    w13, w2 = block.w13, block.w2
    block.w13, block.w2 = _fp8_like(w13), _fp8_like(w2)
    if quant.scheme == "block":
        block.w13_scale = _scale_param((e, 2 * groups(n), groups(h)), w13, _w13_blocks(block))
        block.w2_scale = _scale_param((e, groups(h), groups(n)), w2, _w2_blocks(block))
        block.experts_fn = BLOCK_FP8_EXPERTS
    else:
        block.w13_scale = _scale_param((e, 2 * n), w13, _w13_rows(block))
        block.w2_scale = _scale_param((e, h), w2, _w2_rows)


def _w13_blocks(block: SparseMoeBlock) -> Any:
    def load(param: nn.Parameter, src: WeightSource, shard_id: tuple[int, int]) -> None:
        expert, which = shard_id
        check_shape("an expert gate/up_proj's block scales", src_shape(src),
                    (groups(block.inter), groups(block.hidden_size)))
        n = block.inter_local
        nb = groups(n)  # a rank's rows are whole blocks at TP > 1 (checked in convert)
        param.data[expert].narrow(0, which * nb, nb).copy_(
            read(src, 0, tp().rank * n // GROUP, nb).float())
    return load


def _w2_blocks(block: SparseMoeBlock) -> Any:
    def load(param: nn.Parameter, src: WeightSource, shard_id: tuple[int, int]) -> None:
        check_shape("an expert down_proj's block scales", src_shape(src),
                    (groups(block.hidden_size), groups(block.inter)))
        n = block.inter_local
        param.data[shard_id[0]].copy_(read(src, 1, tp().rank * n // GROUP, groups(n)).float())
    return load


def _scalar(src: WeightSource) -> float | None:
    """A one-element (per-tensor) scale's value, None for a larger one."""
    if int(torch.tensor(src_shape(src)).prod().item()) != 1:
        return None
    t = src if isinstance(src, torch.Tensor) else src[...]
    return float(torch.as_tensor(t).float().reshape(()).item())


def _w13_rows(block: SparseMoeBlock) -> Any:
    def load(param: nn.Parameter, src: WeightSource, shard_id: tuple[int, int]) -> None:
        expert, which = shard_id
        n = block.inter_local
        dst = param.data[expert].narrow(0, which * n, n)
        scalar = _scalar(src)
        if scalar is not None:
            dst.fill_(scalar)
            return
        check_shape("an expert gate/up_proj's channel scales", src_shape(src), (block.inter, 1))
        dst.copy_(read(src, 0, tp().rank * n, n).float().view(-1))
    return load


def _w2_rows(param: nn.Parameter, src: WeightSource, shard_id: tuple[int, int]) -> None:
    dst = param.data[shard_id[0]]
    scalar = _scalar(src)
    if scalar is not None:
        dst.fill_(scalar)
        return
    check_shape("an expert down_proj's channel scales", src_shape(src), (dst.shape[0], 1))
    dst.copy_(read(src).float().view(-1))


def _dequantize(w: torch.Tensor, scale: torch.Tensor, parts: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Stacked fp8 experts -> `dtype`, one expert at a time (the fp32 copy stays one expert's)."""
    out = torch.empty(w.shape, dtype=dtype, device=w.device)
    for e in range(w.shape[0]):
        if scale.dim() == 3:
            out[e] = dequantize_expert(w[e], scale[e], parts).to(dtype)
        else:
            out[e] = (w[e].float() * scale[e].unsqueeze(1)).to(dtype)
    return out


def finalize(model: nn.Module, keep_fp8: bool, dtype: torch.dtype) -> int:
    """After loading: fp8 experts stay (keep_fp8) or are dequantized into `dtype`; DeepSeek's
    latent projections settle (fp8_mla.finalize). The count of fp8 modules handled here."""
    count = fp8_mla.finalize(model, dtype)
    for mod in model.modules():
        # (4-bit experts have no w13: quant_load/w4_moe.py)
        if not isinstance(mod, SparseMoeBlock) or mod.w13 is None or mod.w13.dtype != FP8:
            continue
        count += 1
        if keep_fp8:
            continue
        s13, s2 = mod.w13_scale, mod.w2_scale
        assert isinstance(s13, torch.Tensor) and isinstance(s2, torch.Tensor)
        mod.w13 = nn.Parameter(_dequantize(mod.w13.data, s13.data, 2, dtype), requires_grad=False)
        mod.w2 = nn.Parameter(_dequantize(mod.w2.data, s2.data, 1, dtype), requires_grad=False)
        for name in ("w13_scale", "w2_scale"):  # back to the unquantized block's None buffers
            del mod._parameters[name]
            mod.register_buffer(name, None)
        mod.experts_fn = fused_moe
    return count
