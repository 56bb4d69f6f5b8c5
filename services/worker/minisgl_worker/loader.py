"""Building a model and filling its weights: from a HF safetensors checkpoint, or dummy.

Checkpoints: `model.safetensors.index.json` + shards, or any `*.safetensors` files. Each shard is
opened on the target device and each tensor read through a slice, so a TP rank reads only its
part and host memory never holds more than one tensor. The dummy format needs config.json only:
real shapes, random weights (normal, std 0.02; norm scales 1) from `dummy_seed`, for benchmarks.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from minisgl_core.progress import progress
from safetensors import safe_open

from .model_config import ModelConfig
from .models import CausalLM, model_class
from .prequant_load import bytes_by_format, finalize, keeps_fp8, prepare, target_fn
from .quantize import quantize_model

log = logging.getLogger(__name__)
FP8_SCHEMES = ("block", "tensor", "channel")
DUMMY_STD = 0.02


@contextmanager
def _defaults(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def build_model(cfg: ModelConfig, max_positions: int, device: torch.device,
                dtype: torch.dtype) -> CausalLM:
    """The model with uninitialised weights, allocated on `device` (may be "meta")."""
    cls = model_class(cfg.architecture)
    with _defaults(device, dtype):
        model = cls(cfg, max_positions)
    return model.eval().requires_grad_(False)


def checkpoint_files(model_path: str | Path) -> list[Path]:
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"shards named in {index} are missing: {missing}")
        return files
    return sorted(root.glob("*.safetensors"))


def load_safetensors(model: CausalLM, files: list[Path], device: torch.device) -> None:
    params = dict(model.named_parameters())
    target_of = target_fn(model, model.cfg.quant)  # scale tensors of an fp8 checkpoint too
    loaded: dict[str, set[object]] = {}  # parameter -> shard ids filled
    unmatched: list[str] = []
    beyond: set[int] = set()  # layers past num_hidden_layers (MTP heads, a truncated config)
    skipped: dict[str, int] = {}  # reason -> tensors (a multimodal checkpoint's vision part)
    for path in progress(files, total=len(files), desc="loading weights", unit="file"):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                reason = model.skip_reason(name)
                if reason is not None:
                    skipped[reason] = skipped.get(reason, 0) + 1
                    continue
                target = target_of(name)
                if target is None:
                    continue
                pname, shard_id = target
                param = params.get(pname)
                if param is None:
                    layer = _layer_index(pname)
                    if layer is not None and layer >= model.cfg.num_layers:
                        beyond.add(layer)
                    else:
                        unmatched.append(name)
                    continue
                src = f.get_slice(name)
                _check_fp8(name, src.get_dtype(), param)
                # weight_loader / num_shards: attributes layers/weights.py sets on each Parameter.
                param.weight_loader(param, src, shard_id)  # type: ignore[attr-defined]
                loaded.setdefault(pname, set()).add(shard_id)
    for reason, count in skipped.items():
        log.info("skipped %d checkpoint tensors: %s", count, reason)
    if beyond:
        log.info("skipped checkpoint layers %s: the config has %d layers", sorted(beyond),
                 model.cfg.num_layers)
    if unmatched:
        # Never serve weights that were not all loaded: an unknown tensor (a quantization scale,
        # a packed 4-bit weight, a layer this architecture lacks) means we would compute another
        # function than the checkpoint's.
        raise ValueError(f"checkpoint tensor {unmatched[0]!r} matches no parameter of "
                         f"{type(model).__name__} ({len(unmatched)} such tensors); refusing to "
                         "serve a model whose weights were not all loaded")
    missing = sorted(name for name, p in params.items()
                     if len(loaded.get(name, ())) < p.num_shards)  # type: ignore[attr-defined]
    if missing:
        raise ValueError(f"checkpoint lacks tensors for {len(missing)} parameters, e.g. "
                         f"{missing[:5]}")


def _check_fp8(name: str, src_dtype: str, param: torch.nn.Parameter) -> None:
    """An fp8 tensor fills only an fp8 parameter (one with scales, prequant_load.py), and an
    fp8 parameter only fp8 tensors: copying one into the other would silently change the values."""
    src_fp8, dst_fp8 = src_dtype.startswith("F8"), param.dtype == torch.float8_e4m3fn
    if src_fp8 == dst_fp8 and (not src_fp8 or src_dtype == "F8_E4M3"):
        return
    want = "an fp8 e4m3 weight with its scales" if dst_fp8 else str(param.dtype)
    raise ValueError(f"checkpoint tensor {name!r} is {src_dtype} where {want} was expected "
                     "(a quantized tensor without scales, or scales without fp8 weights); "
                     "refusing to serve weights that would load wrong")


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _layer_index(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def init_dummy(model: CausalLM, seed: int) -> None:
    """Draws in fp32 and rounds to the model's dtype, so a bf16 and an fp32 model from the same
    seed hold the same weights up to rounding (CUDA's normal_ walks its random stream differently
    per dtype: drawn in bf16 directly, an fp32 reference would be another model altogether)."""
    params = list(model.named_parameters())
    if not params or params[0][1].device.type == "meta":
        return
    gen = torch.Generator(device=params[0][1].device).manual_seed(seed)
    for name, p in params:
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            draw = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            p.data.copy_(draw.normal_(0.0, DUMMY_STD, generator=gen))


def load_model(model_path: str | Path, cfg: ModelConfig, load_format: str, max_positions: int,
               device: torch.device, dtype: torch.dtype, dummy_seed: int = 0,
               quantization: str = "none") -> CausalLM:
    """The model with its weights; with quantization="fp8" the projections and MoE experts
    are then turned into fp8 rows (quantize.py) and the freed memory handed back."""
    model = build_model(cfg, max_positions, device, dtype)
    if load_format == "dummy":
        init_dummy(model, dummy_seed)
    else:
        files = checkpoint_files(model_path)
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors in {model_path}; pass --load-format dummy for random weights")
        prepare(model, cfg, files, quantization)
        load_safetensors(model, files, device)
        if cfg.quant is not None:
            keep = keeps_fp8(device, dtype)
            n = finalize(model, keep, dtype)
            how = ("kept in fp8 (fp8 GEMMs)" if keep else f"dequantized to {dtype} at load "
                   "(no fp8 tensor cores or not bf16)") if cfg.quant.scheme in FP8_SCHEMES else \
                "4-bit: see the line above"  # quant_load/w4.py logs kept / dequantized
            log.info("pre-quantized checkpoint (%s): %d quantized layers, %s",
                     cfg.quant.describe(), n, how)
    log.info("weight bytes by format: %s", bytes_by_format(model))
    if quantize_model(model, quantization):
        log.info("quantized the projections and experts to %s", quantization)
        if device.type == "cuda":  # the KV cache is sized from free memory next
            torch.cuda.empty_cache()
    return model
