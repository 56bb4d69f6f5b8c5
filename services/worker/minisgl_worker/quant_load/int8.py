"""Loading compressed-tensors `int-quantized` (INT8 W8A8) checkpoints: the format is in
quant/int8.py, the GPU kernels in kernels/int8_gemm.py.

Before the weights are read (prepare), the checkpoint's tensor names say which projections are
int8: those with a `weight_scale`. Each such ColumnParallelLinear / RowParallelLinear gets a
PackedInt8Linear as its `packed` module (layers/fp8_linear.py), holding this rank's int8 rows
[N, K] (column-parallel: its rows of every part, q|k|v or gate|up; row-parallel: its K slice),
their fp32 scales [N, 1] (a per-tensor scale repeated over its part's rows) and, for static
activations, the input scale (one for the parts: the largest, so no part's input saturates); its
own `weight` goes. Zero points (all zero in symmetric checkpoints) are checked here and dropped;
an int8 weight without scales, or a float weight bound for int8 rows, is refused.

After loading (finalize): on a GPU with int8 tensor cores (Ampere and newer) the int8 rows stay
and the Triton kernels run them; elsewhere (CPU) each projection is dequantized into the model
dtype and runs as a plain linear layer, the checkpoint's function without activation rounding.
`keeps_int8` is the switch tests turn to run the kept path's reference formula on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ..distributed import tp
from ..layers.fp8_linear import Fp8Linear
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from ..layers.weights import WeightSource, check_shape, read, set_loader, src_shape
from ..model_config import ModelConfig
from ..quant.int8 import dequantize, reference_linear

log = logging.getLogger(__name__)
Target = tuple[str, Any]
Linear = ColumnParallelLinear | RowParallelLinear
_SCALES = {".weight_scale": "weight_scale", ".input_scale": "input_scale"}
_ZERO_POINTS = (".weight_zero_point", ".input_zero_point")


class PackedInt8Linear(nn.Module):
    """x @ (weight * weight_scale).T with x quantized to int8 per token (or input_scale)."""

    def __init__(self, n: int, k: int, static: bool, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, k, dtype=torch.int8, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.zeros(n, 1, device=device), requires_grad=False)
        self.input_scale = nn.Parameter(torch.zeros(1, device=device),
                                        requires_grad=False) if static else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from ..kernels import int8_gemm  # imports triton

            return int8_gemm.linear(x, self.weight, self.weight_scale, self.input_scale)
        return reference_linear(x, self.weight, self.weight_scale,
                                self.input_scale).to(x.dtype)


def _dtype(src: WeightSource) -> str:
    return str(src.dtype).replace("torch.", "") if isinstance(src, torch.Tensor) else \
        str(src.get_dtype()).lower()


def _check_int8(src: WeightSource, what: str) -> None:
    if _dtype(src) not in ("i8", "int8"):
        raise ValueError(f"checkpoint tensor for {what} is {_dtype(src)} where int8 was expected "
                         "(a projection whose parts are not all int8 with scales)")


def _column_weight(mod: ColumnParallelLinear) -> Any:
    def load(param: nn.Parameter, src: WeightSource, shard_id: int | None = None) -> None:
        i = shard_id or 0
        _check_int8(src, f"int8 part {i}")
        check_shape(f"int8 part {i}", src_shape(src), (mod.full_sizes[i], param.shape[1]))
        n = mod.local_sizes[i]
        param.data.narrow(0, mod.offsets[i], n).copy_(read(src, 0, tp().rank * n, n))
    return load


def _row_weight(mod: RowParallelLinear) -> Any:
    def load(param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
        _check_int8(src, "a row-parallel int8 weight")
        check_shape("a row-parallel int8 weight", src_shape(src),
                    (param.shape[0], mod.in_features))
        k = mod.in_local
        param.data.copy_(read(src, 1, tp().rank * k, k))
    return load


def _numel(src: WeightSource) -> int:
    n = 1
    for d in src_shape(src):
        n *= d
    return n


def _column_scale(mod: ColumnParallelLinear) -> Any:
    def load(param: nn.Parameter, src: WeightSource, shard_id: int | None = None) -> None:
        i = shard_id or 0
        n = mod.local_sizes[i]
        dst = param.data.narrow(0, mod.offsets[i], n)
        if _numel(src) == 1:  # strategy tensor: the part's one scale on each of its rows
            dst.fill_(read(src).float().reshape(()).item())
            return
        check_shape(f"int8 channel scales of part {i}", src_shape(src), (mod.full_sizes[i], 1))
        dst.copy_(read(src, 0, tp().rank * n, n).float())
    return load


def _row_scale(param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
    if _numel(src) == 1:
        param.data.fill_(read(src).float().reshape(()).item())
        return
    check_shape("row-parallel int8 channel scales", src_shape(src), tuple(param.shape))
    param.data.copy_(read(src).float())


def _max_input_scale(param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
    """The parts of a packed projection share one input, quantized once: the largest scale."""
    if _numel(src) != 1:
        raise ValueError(f"a static int8 input_scale must have one element, got "
                         f"{src_shape(src)}")
    param.data.copy_(torch.maximum(param.data, read(src).float().reshape(1)))


def _install(mod: Linear, static: bool) -> None:
    """Replace mod's weight by a PackedInt8Linear of the same (per-rank) shape."""
    w = mod.weight
    shards = w.num_shards  # type: ignore[attr-defined]
    packed = PackedInt8Linear(w.shape[0], w.shape[1], static, w.device)
    col = isinstance(mod, ColumnParallelLinear)
    set_loader(packed.weight, _column_weight(mod) if col else _row_weight(mod), shards)  # type: ignore[arg-type]
    set_loader(packed.weight_scale, _column_scale(mod) if col else _row_scale, shards)  # type: ignore[arg-type]
    if packed.input_scale is not None:
        set_loader(packed.input_scale, _max_input_scale, shards)
    del mod.weight
    mod.packed = packed


def prepare(model: nn.Module, cfg: ModelConfig, files: list[Path]) -> None:
    """Give every projection the checkpoint stores in int8 its PackedInt8Linear."""
    assert cfg.quant is not None
    experts = cfg.num_experts or int(cfg.raw.get("n_routed_experts") or 0)
    if experts:
        raise ValueError("compressed-tensors int-quantized (INT8 W8A8) MoE checkpoints are not "
                         f"supported (config.json has {experts} experts); use the bf16 one")
    weight_target: Callable[[str], Target | None] = model.weight_target  # type: ignore[assignment]
    scaled: dict[str, str] = {}  # our module -> a checkpoint scale naming it
    scales: set[str] = set()
    int8_weights: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.endswith(_ZERO_POINTS):
                    if f.get_tensor(name).count_nonzero().item():
                        raise ValueError(f"checkpoint tensor {name!r} has non-zero zero points: "
                                         "asymmetric int8 is not implemented")
                    continue
                base = name.rsplit(".", 1)[0]
                t = weight_target(base + ".weight")
                if t is None or not t[0].endswith(".weight"):
                    continue
                module = t[0][: -len(".weight")]
                if name.endswith(".weight_scale"):
                    scaled.setdefault(module, name)
                    scales.add(name)
                elif name.endswith(".weight") and f.get_slice(name).get_dtype() == "I8":
                    int8_weights.append(name)
    for weight in sorted(int8_weights):
        if weight + "_scale" not in scales:
            raise ValueError(f"checkpoint tensor {weight!r} is int8 without a weight_scale; "
                             "refusing to serve weights that would load wrong")
    for module, scale in sorted(scaled.items()):
        try:
            mod = model.get_submodule(module)
        except AttributeError:
            continue  # a layer past num_hidden_layers: the loader skips its tensors
        if not isinstance(mod, ColumnParallelLinear | RowParallelLinear):
            raise ValueError(f"checkpoint tensor {scale!r} scales {module} "
                             f"({type(mod).__name__}), which this engine keeps unquantized; "
                             "only the attention and MLP projections load as int8")
        _install(mod, cfg.quant.static_activations)


def target_fn(model: nn.Module) -> Callable[[str], Target | None]:
    """Checkpoint name -> (parameter, shard id): a converted projection's weight and scales go
    to its packed module; zero points (checked by prepare) are dropped."""
    weight_target: Callable[[str], Target | None] = model.weight_target  # type: ignore[assignment]
    params = {name for name, _ in model.named_parameters()}

    def target(name: str) -> Target | None:
        suffix = next((s for s in (*_SCALES, *_ZERO_POINTS, ".weight") if name.endswith(s)), "")
        if not suffix:
            return weight_target(name)
        t = weight_target(name[: -len(suffix)] + ".weight")
        if t is None or not t[0].endswith(".weight"):
            return t if suffix == ".weight" else None
        packed = t[0][: -len("weight")] + "packed."
        if suffix in _ZERO_POINTS:
            return None
        if suffix == ".weight":
            return (packed + "weight", t[1]) if packed + "weight" in params else t
        # a scale of a projection we keep unquantized: by its own name, so the loader refuses it
        return (packed + _SCALES[suffix], t[1]) if packed + "weight" in params else (name, None)

    return target


def keeps_int8(device: torch.device) -> bool:
    """Whether int8 rows stay int8 (the Triton kernels: int8 tensor cores, sm80+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def finalize(model: nn.Module, dtype: torch.dtype) -> int:
    """After loading: dequantize each int8 projection into `dtype` unless keeps_int8; the count
    of int8 projections."""
    count = 0
    for mod in model.modules():
        packed = getattr(mod, "packed", None)
        if not isinstance(mod, Fp8Linear) or not isinstance(packed, PackedInt8Linear):
            continue
        count += 1
        if keeps_int8(packed.weight.device):
            continue
        w = dequantize(packed.weight.data, packed.weight_scale.data)
        mod.packed = None
        mod.weight = nn.Parameter(w.to(dtype), requires_grad=False)
    if count:
        log.info("int8 projections: %d, %s", count, "kept in int8 (int8 GEMMs)" if keeps_int8(
            next(model.parameters()).device) else f"dequantized to {dtype} at load")
    return count
