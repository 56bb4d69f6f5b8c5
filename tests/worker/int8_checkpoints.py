"""Tiny compressed-tensors `int-quantized` (INT8 W8A8) checkpoints in llm-compressor's on-disk
layout, written from an unquantized safetensors checkpoint, and the dequantized weights they
stand for (what HF transformers computes with). Written from the public definitions of the format
(compressed-tensors' int-quantized compressor, QuantizationArgs), independently of the engine:

  channel  weights strategy channel: `weight` int8 [N, K], `weight_scale` [N, 1] in bf16 (the
           model dtype, as llm-compressor stores it; the weights are rounded with that stored
           scale); activations dynamic per token: no activation tensors
  tensor   weights strategy tensor: `weight_scale` [1]; activations static per tensor:
           `input_scale` [1] (calibrated max |input| / 127); all-zero `weight_zero_point` /
           `input_zero_point` (int8, the scales' shapes) as older compressed-tensors versions
           stored them for symmetric schemes

dequantized = weight * weight_scale (symmetric: no zero point), in fp32.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("channel", "tensor")
PROJ = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def _args(strategy: str, dynamic: bool, observer: str | None) -> dict:
    """One QuantizationArgs as compressed-tensors serializes it (every field, in its order)."""
    return {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None,
            "strategy": strategy, "block_structure": None, "dynamic": dynamic, "actorder": None,
            "observer": observer, "observer_kwargs": {}}


def quantization_config(fmt: str, ignore: list[str]) -> dict:
    static = fmt == "tensor"
    group = {"targets": ["Linear"], "weights": _args(fmt, False, "minmax"),
             "input_activations": _args("tensor" if static else "token", not static,
                                        "minmax" if static else None),
             "output_activations": None, "format": "int-quantized"}
    return {"config_groups": {"group_0": group}, "format": "int-quantized",
            "global_compression_ratio": None, "ignore": ["lm_head", *ignore],
            "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {},
            "transform_config": {}, "version": "0.11.0"}


def _round(t: torch.Tensor) -> torch.Tensor:
    """int8 of t / scale: round half to even (torch.round), saturated."""
    return torch.round(t).clamp(-128, 127).to(torch.int8)


def write_int8_checkpoint(src: Path, dst: Path, fmt: str, ignore: list[str] = (),  # type: ignore[assignment]
                          input_amax: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """dst: src's files with every layer projection (but modules in `ignore`) int8 in format
    `fmt`; returns the dequantized state dict (all tensors, fp32). input_amax: a module's
    calibrated max |input| (static activations; default 8)."""
    assert fmt in FORMATS, fmt
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"), dirs_exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    out: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        module = name[: -len(".weight")]
        if not PROJ.match(name) or module in ignore:
            out[name], ref[name] = w, w.float()
            continue
        w = w.float()
        if fmt == "channel":
            scale = torch.stack([row.abs().max() / 127.0 for row in w]).reshape(-1, 1)
        else:
            scale = (w.abs().max() / 127.0).reshape(1)
        scale = scale.to(torch.bfloat16)  # stored in the model dtype; rounding uses it
        q = _round(w / scale.float())
        out[name], out[module + ".weight_scale"] = q, scale
        if fmt == "tensor":
            amax = (input_amax or {}).get(module, 8.0)
            out[module + ".input_scale"] = torch.tensor([amax / 127.0], dtype=torch.bfloat16)
            out[module + ".weight_zero_point"] = torch.zeros(1, dtype=torch.int8)
            out[module + ".input_zero_point"] = torch.zeros(1, dtype=torch.int8)
        ref[name] = q.float() * scale.float()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(fmt, list(ignore))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return ref


def input_scales(path: Path) -> dict[str, torch.Tensor]:
    """A static checkpoint's input_scale per module (fp32)."""
    tensors = load_file(str(path / "model.safetensors"))
    return {k[: -len(".input_scale")]: v.float() for k, v in tensors.items()
            if k.endswith(".input_scale")}


def round_activations(hf: torch.nn.Module, quantized: set[str],
                      scales: dict[str, torch.Tensor] | None = None) -> None:
    """Makes the HF model compute the W8A8 function: the input of every linear in `quantized`
    is rounded to int8 and back (x -> round(x / s) * s, saturated), with s its static scale or,
    without `scales`, max |x| / 127 per token."""
    tiny = torch.finfo(torch.float32).tiny
    for name, mod in hf.named_modules():
        if name not in quantized:
            continue

        def hook(m, args, name=name):  # noqa: ANN001, ANN202
            x = args[0]
            s = scales[name] if scales else (x.abs().amax(-1, keepdim=True) / 127).clamp_min(tiny)
            return (_round(x / s).float() * s,)

        mod.register_forward_pre_hook(hook)
