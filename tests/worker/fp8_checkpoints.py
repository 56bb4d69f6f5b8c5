"""Tiny pre-quantized FP8 checkpoints in the publishers' on-disk layouts, written from an
unquantized safetensors checkpoint, and the dequantized weights they stand for (the reference
HF transformers computes with). Written independently of the engine's code (block loops here,
not its expanded scales), after transformers' finegrained_fp8 integration and compressed-tensors:

  block      quant_method fp8, weight_block_size [128, 128]: `weight` e4m3 [N, K],
             `weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)], dequantized = q * its block's scale
  tensor     quant_method fp8, no block size, static activations: `weight_scale` fp32 scalar,
             `input_scale` fp32 scalar
  ct_channel compressed-tensors float-quantized, weights strategy channel (`weight_scale`
             [N, 1] in bf16, as llm-compressor writes it in the model dtype), dynamic per-token
             activations
  ct_tensor  compressed-tensors float-quantized, weights strategy tensor (`weight_scale` [1]),
             static per-tensor activations (`input_scale` [1])
  tensor_dynamic  quant_method fp8, no block size, dynamic activations: `weight_scale` scalar

Quantized: every layer projection, MoE experts (`mlp.experts.{e}.*_proj`, one tensor set per
expert as Qwen3-MoE-FP8 and DeepSeek-V3 ship them) and shared experts, and DeepSeek's latent
projections (q_a/q_b/kv_a_proj_with_mqa/kv_b/o_proj); routers (`mlp.gate`) stay unquantized.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("block", "tensor", "ct_channel", "ct_tensor")
MOE_FORMATS = ("block", "ct_channel", "tensor_dynamic")  # the expert layouts that load
FP8 = torch.float8_e4m3fn
PROJ = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.((experts\.\d+|shared_experts)\.)?"
                  r"\w+_proj(_with_mqa)?\.weight$")


def _q(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (t / s).clamp(-448.0, 448.0).to(FP8)


def quant_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q, scale_inv [ceil(N/128), ceil(K/128)], dequantized), one block at a time."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    q, scale, deq = torch.empty(n, k, dtype=FP8), torch.empty(nb, kb), torch.empty(n, k)
    for i in range(nb):
        for j in range(kb):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            s = w[rows, cols].abs().max() / 448.0
            scale[i, j] = s
            q[rows, cols] = _q(w[rows, cols], s)
            deq[rows, cols] = q[rows, cols].float() * s
    return q, scale, deq


def _ct_group(strategy: str, static: bool) -> dict:
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
            "strategy": "tensor" if static else "token", "group_size": None,
            "block_structure": None, "actorder": None, "observer": None, "observer_kwargs": {}}
    return {"group_0": {
        "targets": ["Linear"], "output_activations": None, "input_activations": acts,
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                    "strategy": strategy, "group_size": None, "block_structure": None,
                    "actorder": None, "observer": "minmax", "observer_kwargs": {}}}}


def quantization_config(fmt: str, ignore: list[str]) -> dict:
    if fmt == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [128, 128], "modules_to_not_convert": ignore}
    if fmt == "tensor":
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ignore}
    if fmt == "tensor_dynamic":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ignore}
    strategy, static = ("channel", False) if fmt == "ct_channel" else ("tensor", True)
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": _ct_group(strategy, static), "ignore": ["lm_head", *ignore],
            "kv_cache_scheme": None, "quantization_status": "compressed",
            "global_compression_ratio": 1.5, "version": "0.10.2", "sparsity_config": {}}


def write_fp8_checkpoint(src: Path, dst: Path, fmt: str, ignore: list[str] = (),  # type: ignore[assignment]
                         input_amax: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """dst: src's files with every layer projection (but those in `ignore`, module names)
    quantized in format `fmt`; returns the dequantized state dict (all tensors, fp32).
    input_amax: a module's calibrated max |input| for static formats (default 8)."""
    assert fmt in FORMATS or fmt in MOE_FORMATS, fmt
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
        if fmt == "block":
            q, scale, deq = quant_block(w)
            out[name], out[module + ".weight_scale_inv"] = q, scale
        elif fmt == "ct_channel":
            s = (w.abs().amax(1, keepdim=True) / 448.0).to(torch.bfloat16)
            q = _q(w, s.float())
            out[name], out[module + ".weight_scale"], deq = q, s, q.float() * s.float()
        else:
            s = w.abs().max() / 448.0
            q = _q(w, s)
            shape = (1,) if fmt == "ct_tensor" else ()
            amax = (input_amax or {}).get(module, 8.0)
            out[name], deq = q, q.float() * s
            out[module + ".weight_scale"] = s.reshape(shape)
            if fmt != "tensor_dynamic":
                out[module + ".input_scale"] = torch.tensor(amax / 448.0).reshape(shape)
        ref[name] = deq
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(fmt, list(ignore))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return ref


def calibrate(hf: torch.nn.Module, prompts: list[list[int]]) -> dict[str, float]:
    """max |input| of every linear of an HF model over the prompts (static activation scales)."""
    amax: dict[str, float] = {}
    hooks = []
    for name, mod in hf.named_modules():
        if isinstance(mod, torch.nn.Linear):
            def hook(m, args, out, name=name):  # noqa: ANN001, ANN202
                amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())
            hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        for p in prompts:
            hf(torch.tensor([p]))
    for h in hooks:
        h.remove()
    return amax
