"""Loading 4-bit checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized: quant/w4_config.py)
into the canonical W4A16 layout (quant/w4a16.py).

Before loading (prepare): the checkpoint's tensor names say which projections are packed (those
with a `qweight` / `weight_packed`) and which tensors each has (zero points, g_idx); each such
Column/RowParallelLinear gets a `PackedW4Linear` as `layer.packed` (its plain `weight` removed)
whose parameters take this rank's part of every checkpoint tensor and repack it
(w4_layouts.py); MoE experts get stacked parameters on their block (w4_moe.py).
After loading (finalize): act-order rows are sorted by group (perm, and for a row-parallel rank
whose rows do not form whole groups, gidx), zero points that are all 8 dropped (symmetric); then
on a CUDA fp16/bf16 model the packed form stays (kernels/w4a16_gemm.py); elsewhere each layer is
dequantized once into the model dtype and runs as a plain linear layer: the checkpoint's function.

TP: a column-parallel layer splits N (a rank's share of N whole int32s where N is packed); a
row-parallel one splits K (whole groups a rank, else start-up refuses naming layer and sizes;
act-order: the rank keeps every group's scales and its rows carry their groups in gidx).
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
from ..layers.moe import SparseMoeBlock
from ..layers.weights import WeightSource, set_loader
from ..prequant import CheckpointQuant
from ..quant.w4_config import W4Format
from ..quant.w4a16 import PACK, SYMMETRIC_ZERO, W4Weight, dequantize, pack_rows, reference_linear, unpack_rows
from . import w4_layouts as lay
from . import w4_moe

log = logging.getLogger(__name__)
Target = tuple[str, Any]


def _param(t: torch.Tensor, loader: Any, shards: int) -> nn.Parameter:
    return set_loader(nn.Parameter(t, requires_grad=False), loader, shards)


class PackedW4Linear(nn.Module):
    """A projection's 4-bit weight in the canonical layout: y = x @ W.T (no bias)."""

    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    perm: torch.Tensor | None
    gidx: torch.Tensor | None

    def __init__(self, fmt: W4Format, parts: list[lay.Part], offsets: list[int], group: int,
                 attrs: set[str], dtype: torch.dtype, device: torch.device, name: str) -> None:
        super().__init__()
        self.fmt, self.parts, self.offsets, self.group, self.name = fmt, parts, offsets, group, name
        k, g, n, shards = parts[0].k, parts[0].g, sum(p.n for p in parts), len(parts)
        i32 = torch.int32
        self.qweight = _param(torch.zeros(k // PACK, n, dtype=i32, device=device), self._load_q,
                              shards)
        self.scales = _param(torch.zeros(g, n, dtype=dtype, device=device), self._load_s, shards)
        for attr, make, loader in (
                ("zeros", lambda: torch.zeros(g, n, dtype=dtype, device=device), self._load_z),
                ("g_idx", lambda: torch.zeros(k, dtype=i32, device=device), self._load_g),
                ("shape", lambda: torch.zeros(0, dtype=i32, device=device), self._load_shape)):
            self.register_parameter(attr, _param(make(), loader, shards) if attr in attrs else None)
        self.register_buffer("perm", None)
        self.register_buffer("gidx", None)
        self._g_idx_from: set[int] = set()  # parts whose g_idx is in (they must agree)

    # -- loading: one checkpoint tensor of part i (q, k, v / gate, up) at a time ------------------

    def _cols(self, param: nn.Parameter, i: int) -> torch.Tensor:
        return param.data.narrow(1, self.offsets[i], self.parts[i].n)

    def _load_q(self, param: nn.Parameter, src: WeightSource, shard_id: int | None = None) -> None:
        i = shard_id or 0
        self._cols(param, i).copy_(lay.qweight(self.fmt.layout, src, self.parts[i]))

    def _load_s(self, param: nn.Parameter, src: WeightSource, shard_id: int | None = None) -> None:
        i = shard_id or 0
        self._cols(param, i).copy_(lay.scales(self.fmt.layout, src, self.parts[i]))

    def _load_z(self, param: nn.Parameter, src: WeightSource, shard_id: int | None = None) -> None:
        i = shard_id or 0
        z = lay.zeros(self.fmt.layout, src, self.parts[i], self.fmt.zero_offset)
        self._cols(param, i).copy_(z)

    def _load_g(self, param: nn.Parameter, src: WeightSource, shard_id: int | None = None) -> None:
        """The parts of a packed layer share their input, so one row order: their g_idx must
        agree (GPTQ quantizes q, k, v from the same activations, so they do)."""
        i = shard_id or 0
        g = lay.g_idx(src, self.parts[i]).to(torch.int32)
        if self._g_idx_from and not torch.equal(param.data, g):
            raise ValueError(f"{self.name}: its packed parts {sorted(self._g_idx_from)} and {i} "
                             "have different act-order g_idx; one layer needs one input order")
        param.data.copy_(g)
        self._g_idx_from.add(i)

    def _load_shape(self, param: nn.Parameter, src: WeightSource,
                    shard_id: int | None = None) -> None:
        lay.check_weight_shape(src, self.parts[shard_id or 0])

    # -- after loading ------------------------------------------------------------------------------

    def finish(self) -> None:
        """Sort act-order rows into groups, drop all-8 zero points and the load-only tensors."""
        if self.zeros is not None and bool((self.zeros == SYMMETRIC_ZERO).all()):
            self.zeros = None
        if self.g_idx is not None:
            self._order_rows(self.g_idx.to(torch.int64))
        self.g_idx = self.shape = None

    def _order_rows(self, g: torch.Tensor) -> None:
        p, k = self.parts[0], self.parts[0].k
        # scale rows held: groups [p.g0, p.g0 + p.g) of the checkpoint's
        perm = torch.argsort(g, stable=True)
        local = g[perm] - p.g0
        if bool((local < 0).any() or (local >= p.g).any()):
            raise ValueError(f"{self.name}: g_idx puts rank {tp().rank}'s input features in "
                             f"groups outside its own (act-order) while the config does not say "
                             f"act-order (desc_act / actorder); refusing tp_size={tp().size}")
        natural = torch.arange(k, device=g.device) // self.group
        first = int(local[0])
        if torch.equal(local - first, natural) and first + k // self.group <= p.g:
            # whole groups in order after sorting: keep just this rank's scale rows
            rows = slice(first, first + k // self.group)
            self.scales = nn.Parameter(self.scales.data[rows].contiguous(), requires_grad=False)
            if self.zeros is not None:
                self.zeros = nn.Parameter(self.zeros.data[rows].contiguous(), requires_grad=False)
        else:
            self.gidx = local.to(torch.int32)
        if not torch.equal(perm, torch.arange(k, device=g.device)):
            self.perm = perm.to(torch.int32)
            q = unpack_rows(self.qweight.data)[perm]
            self.qweight = nn.Parameter(pack_rows(q), requires_grad=False)

    def weight(self) -> W4Weight:
        return W4Weight(self.qweight, self.scales, self.zeros, self.group, self.perm, self.gidx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from ..kernels.w4a16_gemm import w4a16_linear  # imports triton

            return w4a16_linear(x, self.weight())
        return reference_linear(x, self.weight())


def _check(cond: bool, name: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {what} (tp_size={tp().size}); refusing to load it")


def _parts(mod: ColumnParallelLinear | RowParallelLinear, name: str, fmt: W4Format,
           attrs: set[str]) -> tuple[list[lay.Part], list[int], int]:
    """(a Part per checkpoint tensor of `mod`, each part's first column, the local group size)."""
    w = mod.weight
    rank, size = tp().rank, tp().size
    packs_n = any(a in attrs for a in lay.N_PACKED[fmt.layout])
    if isinstance(mod, ColumnParallelLinear):
        k = w.shape[1]
        group = k if fmt.group_size == -1 else fmt.group_size
        _check(k % group == 0 and k % PACK == 0, name,
               f"{k} input features are not whole groups of {group}")
        parts = []
        for full, n in zip(mod.full_sizes, mod.local_sizes, strict=True):
            _check(not packs_n or n % PACK == 0, name, f"{full} output features split into {n} "
                   f"per rank, not whole int32s of {PACK} packed 4-bit values")
            parts.append(lay.Part(full, k, rank * n, n, 0, k, group, 0, k // group))
        return parts, list(mod.offsets), group
    n, k_full, k = w.shape[0], mod.in_features, mod.in_local
    _check(not packs_n or n % PACK == 0, name, f"{n} outputs are not whole int32s of {PACK}")
    if fmt.group_size == -1:
        _check(k % PACK == 0, name, f"{k_full} input features split into {k} per rank, not "
               f"whole int32s of {PACK}")
        return [lay.Part(n, k_full, 0, n, rank * k, k, k_full, 0, 1)], [0], k
    group = fmt.group_size
    _check(k_full % group == 0, name, f"{k_full} input features are not whole groups of {group}")
    _check(k % group == 0, name, f"{k_full} input features split into {k} per rank, cutting a "
           f"{group}-wide quantization group (input features per rank must be a multiple of "
           f"{group})")
    # act-order over TP: a rank's rows belong to any group; it keeps all groups' scales
    g0, g = (0, k_full // group) if fmt.act_order and size > 1 else (rank * k // group, k // group)
    return [lay.Part(n, k_full, 0, n, rank * k, k, group, g0, g)], [0], group


def convert_linear(mod: ColumnParallelLinear | RowParallelLinear, name: str, fmt: W4Format,
                   attrs: set[str]) -> None:
    parts, offsets, group = _parts(mod, name, fmt, attrs)
    w = mod.weight
    mod.packed = PackedW4Linear(fmt, parts, offsets, group, attrs, w.dtype, w.device, name)
    mod.register_parameter("weight", None)  # every parameter must be filled: the packed ones are


# -- the loader's hooks (prequant_load.py) ----------------------------------------------------------


def _match(weight_target: Callable[[str], Target | None], layout: str,
           name: str) -> tuple[str, Target | None] | None:
    """(canonical attribute, (parameter, shard id) or None when its weight is not ours) of a
    packed checkpoint tensor; None for any other tensor."""
    for suffix, attr in lay.SUFFIXES[layout].items():
        if name.endswith(suffix):
            t = weight_target(name[: -len(suffix)] + ".weight")
            if t is None:
                return attr, None
            pname, shard = t
            if pname.endswith(".weight"):  # a projection: its packed module
                return attr, (f"{pname[: -len('weight')]}packed.{attr}", shard)
            return attr, (f"{pname}_{attr}", shard)  # stacked experts: w13_qweight, ...
    return None


def target_fn(weight_target: Callable[[str], Target | None],
              quant: CheckpointQuant) -> Callable[[str], Target | None]:
    layout = _fmt(quant).layout

    def target(name: str) -> Target | None:
        m = _match(weight_target, layout, name)
        if m is None:
            return weight_target(name)
        # a packed tensor of a weight we skip or lack: kept by name, so the loader refuses it
        return m[1] if m[1] is not None else (name, None)

    return target


def _fmt(quant: CheckpointQuant) -> W4Format:
    assert isinstance(quant.details, W4Format)
    return quant.details


def prepare(model: nn.Module, quant: CheckpointQuant, files: list[Path]) -> None:
    """Install the packed parameters on every module the checkpoint stores packed."""
    fmt = _fmt(quant)
    weight_target: Callable[[str], Target | None] = model.weight_target  # type: ignore[assignment]
    found: dict[tuple[str, str], tuple[set[str], str]] = {}  # (module, part) -> attrs, a name
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                m = _match(weight_target, fmt.layout, name)
                if m is not None and m[1] is not None:
                    found.setdefault(_owner(m[1][0]), (set(), name))[0].add(m[0])
    experts: dict[str, dict[str, set[str]]] = {}
    for (mod_name, which), (attrs, tensor) in sorted(found.items()):
        mod = _submodule(model, mod_name)
        if mod is None:
            continue  # a layer past num_hidden_layers: the loader skips its tensors
        if isinstance(mod, ColumnParallelLinear | RowParallelLinear) and which == "linear":
            convert_linear(mod, mod_name, fmt, attrs)
        elif type(mod) in w4_moe.BLOCKS and which in ("w13", "w2"):
            experts.setdefault(mod_name, {})[which] = attrs
        else:
            raise ValueError(f"checkpoint tensor {tensor!r} is a 4-bit weight of {mod_name} "
                             f"({type(mod).__name__}), which this engine does not load packed")
    for mod_name, parts in experts.items():
        block = model.get_submodule(mod_name)
        assert isinstance(block, SparseMoeBlock)
        w4_moe.convert_experts(block, mod_name, fmt, parts)


def _owner(pname: str) -> tuple[str, str]:
    """Our parameter name -> (its module, "linear" | "w13" | "w2")."""
    if ".packed." in pname:
        return pname.split(".packed.")[0], "linear"
    mod_name, _, attr = pname.rpartition(".")
    return mod_name, attr.split("_")[0]


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def keeps_packed(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether 4-bit weights stay packed (the CUDA kernels) rather than dequantized at load."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def finalize(model: nn.Module, dtype: torch.dtype) -> int:
    """Finish every packed layer and expert block; dequantize them into `dtype` unless
    keeps_packed; the count of packed projections and expert blocks."""
    count = 0
    for mod in model.modules():
        if isinstance(mod, Fp8Linear) and isinstance(mod.packed, PackedW4Linear):
            packed = mod.packed
            packed.finish()
            count += 1
            if not keeps_packed(packed.qweight.device, dtype):
                w = dequantize(packed.weight()).to(dtype)
                mod.weight = nn.Parameter(w, requires_grad=False)
                mod.packed = None
        elif isinstance(mod, SparseMoeBlock) and w4_moe.is_packed(mod):
            count += 1
            w4_moe.finish(mod, keeps_packed(_device(mod), dtype), dtype)
    if count:
        log.info("4-bit layers: %d projections and expert blocks, %s", count,
                 "kept packed (W4A16 kernels)" if keeps_packed(_device(model), dtype) else
                 f"dequantized to {dtype} at load (no CUDA, or not fp16/bf16)")
    return count


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def byte_kind(name: str) -> str | None:
    """The start-up memory line's name for a 4-bit layer's parameter, None for others."""
    mod_name, _, attr = name.rpartition(".")
    if not mod_name.endswith(".packed"):
        part, _, attr = attr.partition("_")
        if part not in ("w13", "w2"):
            return None
    if attr not in ("qweight", "scales", "zeros"):
        return None
    return "int4 packed weights" if attr == "qweight" else "int4 scales/zeros"
