"""Loading a pre-quantized FP8 checkpoint (formats: prequant.py) into the fp8 projections.

Before the weights are read, the checkpoint's tensor names (safetensors headers only) say which
projections are fp8: those with scale tensors. Each such ColumnParallelLinear / RowParallelLinear
gets an fp8 weight parameter and scale parameters with loaders that take this rank's share, so
the ordinary loader fills them like any weight; layers a config lists as not converted
(modules_to_not_convert, ignored_layers, ignore) have no scales in the checkpoint and load as
they are. A projection's checkpoint parts must agree (all fp8 with scales, or none): the loader
refuses an fp8 tensor bound for an unquantized parameter and the reverse.

After loading (finalize): on a GPU with fp8 tensor cores and bf16 activations the fp8 weights stay
(layers/fp8_linear.py runs them); elsewhere (CPU, older GPUs, fp16/fp32 models) each projection is
dequantized once into the model dtype and runs as a plain linear layer with unquantized
activations: the checkpoint's function without activation rounding.

MoE experts (stacked per block) and DeepSeek's replicated / absorbed latent projections load
through quant_load/fp8_moe.py and quant_load/fp8_mla.py, called from prepare and finalize.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from .distributed import tp
from .fp8 import FP8, has_fp8_tensor_cores
from .fp8_block import GROUP, dequantize_blocks, groups, rows_of_blocks
from .layers.fp8_linear import Fp8Linear
from .layers.linear import ColumnParallelLinear, RowParallelLinear
from .layers.weights import WeightSource, check_shape, read, set_loader, src_shape
from .model_config import ModelConfig
from .prequant import CheckpointQuant
from .quant_load import fp8_moe, w4
from .quant_load import int8 as int8_load
from .quant_load import mxfp4 as mxfp4_load

log = logging.getLogger(__name__)
Target = tuple[str, Any]


def scale_suffixes(quant: CheckpointQuant) -> dict[str, str]:
    """Checkpoint tensor suffix -> our Fp8Linear attribute it fills."""
    if quant.scheme == "block":
        return {".weight_scale_inv": "weight_block_scale"}
    table = {".weight_scale": "weight_scale"}
    if quant.method == "fp8":  # transformers' FP8Linear names a per-tensor scale so too
        table[".weight_scale_inv"] = "weight_scale"
    if quant.static_activations:
        table[".input_scale"] = "input_scale"
        if quant.method == "fp8":
            table[".activation_scale"] = "input_scale"
    return table


def _scale_target(weight_target: Callable[[str], Target | None], suffixes: dict[str, str],
                  name: str) -> tuple[str, Target | None] | None:
    """(our attribute, (parameter, shard id) or None when its weight is not ours) of a scale
    tensor; None for any other tensor."""
    for suffix, attr in suffixes.items():
        if name.endswith(suffix):
            t = weight_target(name[: -len(suffix)] + ".weight")
            if t is not None and fp8_moe.is_experts(t[0]):  # stacked MoE experts
                return attr, fp8_moe.scale_target(t, attr)
            if t is None or not t[0].endswith(".weight"):
                return attr, None
            return attr, (t[0][: -len("weight")] + attr, t[1])
    return None


def target_fn(model: nn.Module, quant: CheckpointQuant | None) -> Callable[[str], Target | None]:
    """The loader's name -> (parameter, shard id) map, scale tensors included: a scale goes to
    the module its weight goes to, with the weight's shard id."""
    weight_target: Callable[[str], Target | None] = model.weight_target  # type: ignore[assignment]
    if quant is None:
        return weight_target
    if quant.scheme == "int8":
        return int8_load.target_fn(model)
    if quant.scheme == "w4":  # AWQ / GPTQ / compressed-tensors pack-quantized
        return w4.target_fn(weight_target, quant)
    suffixes = scale_suffixes(quant)

    def target(name: str) -> Target | None:
        scale = _scale_target(weight_target, suffixes, name)
        if scale is None:
            return weight_target(name)
        # a scale of a weight we skip or do not have: kept by name, so the loader refuses it
        return scale[1] if scale[1] is not None else (name, None)

    return target


def prepare(model: nn.Module, cfg: ModelConfig, files: list[Path], quantization: str) -> None:
    """Turn the projections the checkpoint stores in fp8 into fp8 parameters with scales."""
    quant = cfg.quant
    if quant is None:
        return
    if quantization != "none":
        raise ValueError(f"--quantization {quantization} with a pre-quantized checkpoint "
                         f"({quant.method}): its weights are fp8 already; drop the flag")
    if quant.scheme == "int8":
        return int8_load.prepare(model, cfg, files)
    if quant.scheme == "mxfp4":  # gpt-oss's experts (quant_load/mxfp4.py)
        mxfp4_load.prepare(model, files)
        return
    if quant.scheme == "w4":
        return w4.prepare(model, quant, files)
    weight_target: Callable[[str], Target | None] = model.weight_target  # type: ignore[assignment]
    suffixes = scale_suffixes(quant)
    modules: dict[str, str] = {}  # our module -> a checkpoint scale tensor naming it
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                scale = _scale_target(weight_target, suffixes, name)
                if scale is not None and scale[1] is not None and scale[0] != "input_scale":
                    modules.setdefault(scale[1][0].rsplit(".", 1)[0], name)
    for mod_name, scale_name in sorted(modules.items()):
        try:
            mod = model.get_submodule(mod_name)
        except AttributeError:
            continue  # a layer past num_hidden_layers: the loader skips its tensors
        if fp8_moe.convert(mod, mod_name, quant):  # MoE experts, DeepSeek's latent projections
            continue
        if not isinstance(mod, ColumnParallelLinear | RowParallelLinear):
            raise ValueError(f"checkpoint tensor {scale_name!r} scales {mod_name} "
                             f"({type(mod).__name__}), which this engine keeps unquantized; "
                             "only the attention, MLP and expert projections load as fp8")
        _convert(mod, mod_name, quant)


def _fp8_param(like: nn.Parameter) -> nn.Parameter:
    p = nn.Parameter(torch.empty(like.shape, dtype=FP8, device=like.device), requires_grad=False)
    return set_loader(p, like.weight_loader, like.num_shards)  # type: ignore[attr-defined]


def _scale_param(shape: tuple[int, ...], device: torch.device, loader: Any,
                 shards: int) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=torch.float32, device=device), requires_grad=False)
    return set_loader(p, loader, shards)


def _convert(mod: ColumnParallelLinear | RowParallelLinear, name: str,
             quant: CheckpointQuant) -> None:
    w = mod.weight
    shards = w.num_shards  # type: ignore[attr-defined]
    n, k_local = w.shape
    mod.weight = _fp8_param(w)
    col = isinstance(mod, ColumnParallelLinear)
    if quant.scheme == "block":
        if not col and tp().size > 1 and k_local % GROUP:
            raise ValueError(
                f"tp_size={tp().size} splits {name}'s {mod.in_features} input features into "
                f"{k_local} per rank, cutting a {GROUP}-wide fp8 scale block (block-quantized "
                f"checkpoints need input features per rank divisible by {GROUP})")
        loader = _column_blocks(mod) if isinstance(mod, ColumnParallelLinear) else \
            _row_blocks(mod)
        mod.weight_block_scale = _scale_param((n, groups(k_local)), w.device, loader, shards)
        return
    loader = _column_rows(mod) if isinstance(mod, ColumnParallelLinear) else _row_rows
    mod.weight_scale = _scale_param((n, 1), w.device, loader, shards)
    if quant.static_activations:
        mod.input_scale = _scale_param((1,), w.device, _max_scalar, shards)


def _scalar(src: WeightSource) -> torch.Tensor | None:
    """A one-element scale as a 0-d fp32 tensor, or None for a larger one."""
    shape = src_shape(src)
    if int(torch.tensor(shape).prod().item()) != 1:
        return None
    t = src if isinstance(src, torch.Tensor) else src[...]
    return torch.as_tensor(t).float().reshape(())


def _column_blocks(mod: ColumnParallelLinear) -> Any:
    def load(param: nn.Parameter, src: WeightSource, shard_id: int | None = None) -> None:
        i = shard_id or 0
        full, n = mod.full_sizes[i], mod.local_sizes[i]
        check_shape(f"block scales of packed part {i}", src_shape(src),
                    (groups(full), param.shape[1]))
        start = tp().rank * n
        first, stop = start // GROUP, (start + n - 1) // GROUP + 1
        blocks = read(src, 0, first, stop - first).float()
        param.data.narrow(0, mod.offsets[i], n).copy_(rows_of_blocks(blocks, start, n))
    return load


def _row_blocks(mod: RowParallelLinear) -> Any:
    def load(param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
        n, kb = param.shape
        check_shape("row-parallel block scales", src_shape(src),
                    (groups(n), groups(mod.in_features)))
        blocks = read(src, 1, tp().rank * kb, kb).float()
        param.data.copy_(rows_of_blocks(blocks, 0, n))
    return load


def _column_rows(mod: ColumnParallelLinear) -> Any:
    def load(param: nn.Parameter, src: WeightSource, shard_id: int | None = None) -> None:
        i = shard_id or 0
        n = mod.local_sizes[i]
        dst = param.data.narrow(0, mod.offsets[i], n)
        scalar = _scalar(src)
        if scalar is not None:
            dst.fill_(scalar.item())
            return
        check_shape(f"channel scales of packed part {i}", src_shape(src), (mod.full_sizes[i], 1))
        dst.copy_(read(src, 0, tp().rank * n, n).float())
    return load


def _row_rows(param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
    scalar = _scalar(src)
    if scalar is not None:
        param.data.fill_(scalar.item())
        return
    check_shape("row-parallel channel scales", src_shape(src), tuple(param.shape))
    param.data.copy_(read(src).float())


def _max_scalar(param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
    """A static activation scale: the parts of a packed projection (q, k, v) share one input,
    quantized once, with the largest of their scales (none of them saturates)."""
    scalar = _scalar(src)
    if scalar is None:
        raise ValueError(f"a static input_scale must have one element, got {src_shape(src)}")
    param.data.copy_(torch.maximum(param.data, scalar.reshape(1)))


def keeps_fp8(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether fp8 weights stay fp8 (our GPU kernels) rather than being dequantized at load."""
    return device.type == "cuda" and dtype == torch.bfloat16 and has_fp8_tensor_cores(device)


def finalize(model: nn.Module, keep_fp8: bool, dtype: torch.dtype) -> int:
    """After loading: dequantize each fp8 projection into `dtype` unless keep_fp8; the count of
    fp8 projections in the checkpoint (and of the other formats' layers, quant_load/)."""
    count = fp8_moe.finalize(model, keep_fp8, dtype)  # experts, kv_b_proj, rotary scale rows
    count += w4.finalize(model, dtype)  # 4-bit layers: kept packed on CUDA, else dequantized
    count += int8_load.finalize(model, dtype)
    count += mxfp4_load.finalize(model, dtype)  # MXFP4 experts: kept on CUDA, else dequantized
    for mod in model.modules():
        if (not isinstance(mod, Fp8Linear) or mod.packed is not None or mod.weight is None
                or mod.weight.dtype != FP8):
            continue
        count += 1
        if keep_fp8:
            if mod.weight_block_scale is not None:
                from .kernels.fp8_block_gemm import whole_blocks  # imports triton

                mod.weight_blocks = whole_blocks(mod.weight_block_scale.data)
            continue
        if mod.weight_block_scale is not None:
            w = dequantize_blocks(mod.weight.data, mod.weight_block_scale.data)
        else:
            assert mod.weight_scale is not None
            w = mod.weight.data.float() * mod.weight_scale.data
        mod.weight = nn.Parameter(w.to(dtype), requires_grad=False)
        mod.weight_scale = mod.weight_block_scale = mod.input_scale = None
    return count


def _byte_kind(name: str, t: torch.Tensor) -> str:
    """The start-up memory line's name for a parameter: its format (the storage dtype, or what
    the bytes hold where the dtype does not say it)."""
    scale = name.rsplit(".", 1)[-1].endswith(("scale", "scale_inv", "scales"))
    if t.dtype == torch.uint8:  # gpt-oss's MXFP4 experts (quant_load/mxfp4.py)
        return "mxfp4 scales (e8m0)" if scale else "mxfp4 weights"
    if scale:
        return "quantization scales"
    return str(t.dtype).replace("torch.", "").replace("float8_e4m3fn", "fp8 e4m3")


def bytes_by_format(model: nn.Module) -> str:
    """The resident weight bytes per storage format, scales apart: for the start-up log."""
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    for name, t in model.named_parameters():
        if id(t) in seen or t.device.type == "meta":
            continue
        seen.add(id(t))
        kind = w4.byte_kind(name) or _byte_kind(name, t)
        sizes[kind] = sizes.get(kind, 0) + t.numel() * t.element_size()
    return ", ".join(f"{v / 2**20:.1f} MiB {k}" for k, v in sorted(sizes.items(),
                                                                    key=lambda kv: -kv[1]))
