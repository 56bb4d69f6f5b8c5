"""Loading gpt-oss's MXFP4 experts (quant/mxfp4.py) into GptOssMoeBlocks.

prepare (before the weights are read): each layer whose checkpoint holds
`mlp.experts.gate_up_proj_blocks` gets packed parameters in place of its (meta, see
GptOssMoeBlock.release_experts) bf16 experts; the model maps the checkpoint names onto them
(models/gpt_oss.py: `*_blocks` -> w13 / w2, `*_scales` -> w13_scale / w2_scale):

    w13        uint8 [E, 2n, H/2]    gate rows then up rows: the checkpoint's interleaved rows
    w13_scale  uint8 [E, 2n, H/32]   (gate even, up odd) split apart at load
    w2         uint8 [E, H, n/2]     w2_scale uint8 [E, H, n/32]

with n = I / tp: rank r reads gate_up rows 2rn..2(r+1)n (gate and up of its intermediate
columns, one contiguous slice) and down's K-blocks rn/32..(r+1)n/32, so n must cover whole
32-blocks, else start-up stops naming tp and the sizes. Layers the checkpoint stores in bf16
(modules_to_not_convert) get their bf16 parameters back and load as always.

finalize (after): on CUDA the packed experts stay and `experts_fn` becomes the MXFP4 kernels
(kernels/moe_mxfp4.py); on CPU they are dequantized once into the model dtype and the bf16 path
runs them (exactly the checkpoint's function). Tests set KEEP_PACKED_ON_CPU to keep the packed
form on CPU too (then the reference computes from it, or the Triton interpreter).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..distributed import tp
from ..kernels import moe_mxfp4
from ..layers.gpt_oss_moe import GptOssMoeBlock
from ..layers.weights import WeightSource, check_shape, read, set_loader, src_shape
from ..quant.mxfp4 import BLOCK, BYTES

log = logging.getLogger(__name__)
KEEP_PACKED_ON_CPU = False  # tests: keep the packed experts on CPU (reference / interpreter)
_MARKER = ".mlp.experts.gate_up_proj_blocks"


def prepare(model: nn.Module, files: list[Path]) -> int:
    """Install MXFP4 expert parameters where the checkpoint has them; the count of such layers."""
    packed: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.endswith(_MARKER):
                    packed.add(name[: -len(_MARKER)] + ".mlp")
    blocks = {name: mod for name, mod in model.named_modules()
              if isinstance(mod, GptOssMoeBlock)}
    if packed and not blocks:
        raise ValueError(f"checkpoint has MXFP4 experts ({sorted(packed)[0]}) but "
                         f"{type(model).__name__} has no gpt-oss MoE blocks to hold them")
    for name, block in blocks.items():
        if name in packed:
            _install(block, name)
        else:
            _restore_bf16(block)
    return len(packed & set(blocks))


def _param(shape: tuple[int, ...], device: torch.device, loader: object) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=torch.uint8, device=device), requires_grad=False)
    return set_loader(p, loader)  # type: ignore[arg-type]


def _install(block: GptOssMoeBlock, name: str) -> None:
    e, h, i, n = block.num_experts, block.hidden_size, block.inter, block.inter_local
    if n % BLOCK or h % BLOCK:
        raise ValueError(f"tp_size={tp().size} splits {name}'s intermediate_size={i} into {n} "
                         f"per rank, cutting a {BLOCK}-wide MXFP4 block (MXFP4 experts need "
                         f"intermediate_size / tp and hidden_size={h} divisible by {BLOCK})")
    dev = block.gate.weight.device
    rows = _GateUp(block)
    block.w13 = _param((e, 2 * n, h // 2), dev, rows.blocks)
    block.w13_scale = _param((e, 2 * n, h // BLOCK), dev, rows.scales)
    cols = _Down(block)
    block.w2 = _param((e, h, n // 2), dev, cols.blocks)
    block.w2_scale = _param((e, h, n // BLOCK), dev, cols.scales)


def _restore_bf16(block: GptOssMoeBlock) -> None:
    """A layer stored unquantized: real bf16 (model dtype) parameters again, same loaders."""
    dev, dtype = block.gate.weight.device, block.w13_bias.dtype
    for attr in ("w13", "w2"):
        old = getattr(block, attr)
        if old.device.type != "meta":
            continue
        p = nn.Parameter(torch.empty(old.shape, dtype=dtype, device=dev), requires_grad=False)
        setattr(block, attr, set_loader(p, old.weight_loader, old.num_shards))


class _GateUp:
    """gate_up_proj_blocks [E, 2I, H/32, 16] / _scales [E, 2I, H/32]: this rank's rows 2rn..
    2(r+1)n, de-interleaved into gate rows then up rows."""

    def __init__(self, block: GptOssMoeBlock) -> None:
        self.e, self.h, self.i, self.n = (block.num_experts, block.hidden_size, block.inter,
                                          block.inter_local)

    def _split(self, param: nn.Parameter, part: torch.Tensor) -> None:
        n = self.n
        param.data[:, :n].copy_(part[:, 0::2])
        param.data[:, n:].copy_(part[:, 1::2])

    def blocks(self, param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
        check_shape("mlp.experts.gate_up_proj_blocks", src_shape(src),
                    (self.e, 2 * self.i, self.h // BLOCK, BYTES))
        part = read(src, 1, 2 * tp().rank * self.n, 2 * self.n)
        self._split(param, part.reshape(self.e, 2 * self.n, self.h // 2))

    def scales(self, param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
        check_shape("mlp.experts.gate_up_proj_scales", src_shape(src),
                    (self.e, 2 * self.i, self.h // BLOCK))
        self._split(param, read(src, 1, 2 * tp().rank * self.n, 2 * self.n))


class _Down:
    """down_proj_blocks [E, H, I/32, 16] / _scales [E, H, I/32]: this rank's K-blocks."""

    def __init__(self, block: GptOssMoeBlock) -> None:
        self.e, self.h, self.i, self.n = (block.num_experts, block.hidden_size, block.inter,
                                          block.inter_local)

    def blocks(self, param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
        g = self.n // BLOCK
        check_shape("mlp.experts.down_proj_blocks", src_shape(src),
                    (self.e, self.h, self.i // BLOCK, BYTES))
        param.data.copy_(read(src, 2, tp().rank * g, g).reshape(self.e, self.h, self.n // 2))

    def scales(self, param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
        g = self.n // BLOCK
        check_shape("mlp.experts.down_proj_scales", src_shape(src),
                    (self.e, self.h, self.i // BLOCK))
        param.data.copy_(read(src, 2, tp().rank * g, g))


def _packed(block: GptOssMoeBlock) -> bool:
    return block.w13.dtype == torch.uint8


def finalize(model: nn.Module, dtype: torch.dtype) -> int:
    """After loading: keep each packed layer for the kernels (CUDA) or dequantize it into dtype
    (CPU); the count of MXFP4 layers."""
    count = 0
    for block in model.modules():
        if not isinstance(block, GptOssMoeBlock) or not _packed(block):
            continue
        count += 1
        s13, s2 = block.w13_scale, block.w2_scale
        assert isinstance(s13, torch.Tensor) and isinstance(s2, torch.Tensor)
        if block.w13.is_cuda or KEEP_PACKED_ON_CPU:
            top = max(int(s13.max()), int(s2.max()))
            if top > moe_mxfp4.SCALE_MAX:
                raise ValueError(f"an MXFP4 expert scale of 2^{top - 127} (e8m0 byte {top}) is "
                                 f"beyond the kernels' range (at most 2^"
                                 f"{moe_mxfp4.SCALE_MAX - 127}); refusing to serve it")
            block.experts_fn = moe_mxfp4.mxfp4_moe
            continue
        for attr, scale in (("w13", s13), ("w2", s2)):
            w = moe_mxfp4.dequantize_experts(getattr(block, attr).data, scale.data, dtype)
            setattr(block, attr, nn.Parameter(w, requires_grad=False))
        block.w13_scale = block.w2_scale = None  # type: ignore[assignment]
    if count:
        where = "kept packed (MXFP4 kernels)" if any(
            isinstance(b, GptOssMoeBlock) and _packed(b) for b in model.modules()) else \
            f"dequantized to {dtype} at load"
        log.info("MXFP4 experts in %d layers, %s", count, where)
    return count
