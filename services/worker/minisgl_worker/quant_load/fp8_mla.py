"""DeepSeek's latent-attention projections in a pre-quantized FP8 checkpoint (DeepSeek-V3 / R1:
block fp8 on q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj and o_proj), beyond the column /
row-parallel ones prequant_load converts (q_b_proj / q_proj, o_proj):

  q_a_proj, kv_a_proj_with_mqa   ReplicatedProjection: fp8 weight with per-row scales as the dense
                                 fp8 projections hold them (layers/fp8_linear.py), whole on
                                 every rank; they stay fp8 where the dense ones do.
  kv_b_proj                      LatentUpProjection: absorbed into the query and the output
                                 (layers/mla.py), never applied as a linear layer, so it is
                                 dequantized into the model dtype after loading, everywhere.

DeepSeek rotates interleaved pairs, and the loader permutes the rotary rows of q_b_proj (or
q_proj) and kv_a_proj_with_mqa (mla.py); the per-row scales of those projections are permuted
alike once loaded (`finalize`), so each row keeps its own scale. Static activation scales on
the replicated projections are refused (no DeepSeek checkpoint has them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..distributed import tp
from ..fp8 import FP8
from ..fp8_block import GROUP, dequantize_blocks, groups, rows_of_blocks
from ..layers.fp8_linear import Fp8Linear
from ..layers.linear import ReplicatedProjection
from ..layers.mla import LatentUpProjection, permute_rope_rows
from ..layers.weights import WeightSource, check_shape, read, set_loader, src_shape
from ..prequant import CheckpointQuant


def convert(mod: nn.Module, name: str, quant: CheckpointQuant) -> bool:
    """Give a replicated projection or kv_b_proj fp8 parameters; False for any other module."""
    if not isinstance(mod, ReplicatedProjection | LatentUpProjection):
        return False
    if quant.scheme not in ("block", "tensor", "channel"):
        raise ValueError(f"{name}: {quant.scheme} weights are not implemented here")
    if quant.static_activations and isinstance(mod, ReplicatedProjection):
        raise ValueError(f"{name}: static activation scales (input_scale) on a replicated "
                         "projection are not implemented")
    w = mod.weight
    n, k = w.shape
    fp8 = nn.Parameter(torch.empty(w.shape, dtype=FP8, device=w.device), requires_grad=False)
    mod.weight = set_loader(fp8, w.weight_loader, w.num_shards)  # type: ignore[attr-defined]
    # this rank's first row of the checkpoint tensor (kv_b_proj's heads are split by TP)
    start = tp().rank * n if isinstance(mod, LatentUpProjection) else 0
    full = (mod.heads * (mod.nope + mod.v_dim), k) if isinstance(mod, LatentUpProjection) \
        else (n, k)
    # Fp8Linear declares both as (None) buffers, which a Parameter replaces
    if quant.scheme == "block":
        mod.weight_block_scale = _scale((n, groups(k)), w.device, _blocks(name, full, start))
    else:
        mod.weight_scale = _scale((n, 1), w.device, _rows(name, full, start))
    return True


def _scale(shape: tuple[int, int], device: torch.device, loader: Any) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=torch.float32, device=device), requires_grad=False)
    return set_loader(p, loader)


def _blocks(name: str, full: tuple[int, int], start: int) -> Any:
    def load(param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
        n = param.shape[0]
        check_shape(f"{name}'s block scales", src_shape(src), (groups(full[0]), groups(full[1])))
        first, stop = start // GROUP, (start + n - 1) // GROUP + 1
        param.data.copy_(rows_of_blocks(read(src, 0, first, stop - first).float(), start, n))
    return load


def _rows(name: str, full: tuple[int, int], start: int) -> Any:
    def load(param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
        shape = src_shape(src)
        if int(torch.tensor(shape).prod().item()) == 1:  # per tensor: every row's scale
            t = src if isinstance(src, torch.Tensor) else src[...]
            param.data.fill_(float(torch.as_tensor(t).float().reshape(()).item()))
            return
        check_shape(f"{name}'s channel scales", shape, (full[0], 1))
        param.data.copy_(read(src, 0, start, param.shape[0]).float())
    return load


def _row_scales(mod: nn.Module) -> torch.Tensor | None:
    for attr in ("weight_block_scale", "weight_scale"):
        t = getattr(mod, attr, None)
        if isinstance(t, torch.Tensor):
            return t
    return None


def finalize(model: nn.Module, dtype: torch.dtype) -> int:
    """After loading: per-row scales of rotary-permuted fp8 projections permuted like their rows;
    kv_b_proj dequantized into `dtype`. The count of fp8 kv_b_proj."""
    count = 0
    for mod in model.modules():
        weight = getattr(mod, "weight", None)  # a packed (W4, INT8) projection has none
        if not isinstance(mod, Fp8Linear | LatentUpProjection) or \
                not isinstance(weight, torch.Tensor) or weight.dtype != FP8:
            continue
        scale = _row_scales(mod)
        rope = getattr(getattr(weight, "weight_loader", None), "rope_rows", None)
        if rope is not None and scale is not None:
            permute_rope_rows(scale, *rope)  # type: ignore[arg-type]
        if not isinstance(mod, LatentUpProjection) or scale is None:
            continue
        count += 1
        block = "weight_block_scale" in mod._parameters
        deq = dequantize_blocks(weight.data, scale.data) if block else \
            weight.data.float() * scale.data
        mod.weight = nn.Parameter(deq.to(dtype), requires_grad=False)
        del mod._parameters["weight_block_scale" if block else "weight_scale"]
    return count
