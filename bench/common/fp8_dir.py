"""Write a synthetic full-size block-FP8 checkpoint (Qwen3-*-FP8 / DeepSeek-V3 layout) for a shipped
config.json, so our engine and vLLM load the same weights:

    python -m bench.common.fp8_dir models/configs/Qwen3-30B-A3B /tmp/q30-fp8 [--layers 8] [--seed 0]

Every layer projection (q/k/v/o, gate/up/down, each expert's gate/up/down, shared experts,
DeepSeek's latent projections) is e4m3 `weight` [N, K] with `weight_scale_inv` fp32
[ceil(N/128), ceil(K/128)] (one scale a 128x128 block, max |block| / 448); embeddings, norms,
routers and the LM head are bf16. config.json gets quantization_config {quant_method fp8,
activation_scheme dynamic, fmt e4m3, weight_block_size [128, 128]}: what vLLM's Fp8Config and
transformers' FineGrainedFP8Config read. The tokenizer is bench.common.model_dir's synthetic one.

Weights are drawn on the GPU when there is one (normal, std 0.02; norms 1; DeepSeek's router
bias 0), quantized there, and written as 4 GB shards with an index, one tensor at a time: a
30B-A3B model takes about a minute on an H200 (mostly the disk). Shapes come from the meta-device
HF model of the config, so every tensor name is the checkpoint's own.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from bench.common.model_dir import make
from bench.common.shards import ShardWriter

BLOCK = 128
FP8 = torch.float8_e4m3fn
QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.((experts\.\d+|shared_experts)\.)?"
                       r"\w+_proj(_with_mqa)?\.weight$")


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (e4m3 [..., N, K], fp32 scale_inv [..., ceil(N/128), ceil(K/128)]), the
    block formula (one scale a 128x128 block, max |block| / 448), vectorized."""
    *lead, n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.nn.functional.pad(w.float(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    blocks = padded.view(*lead, nb, BLOCK, kb, BLOCK)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(torch.finfo(torch.float32).tiny) / 448.0
    q = (blocks / scale[..., :, None, :, None]).clamp(-448.0, 448.0).to(FP8)
    return q.view(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k].contiguous(), scale


def _shapes(out: Path, layers: int | None) -> tuple[dict[str, tuple[int, ...]], dict]:
    """Checkpoint tensor name -> shape, from the HF model of the config on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(out)
    if layers:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:layers]
        if getattr(cfg, "mlp_only_layers", None):
            cfg.mlp_only_layers = [i for i in cfg.mlp_only_layers if i < layers]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    shapes = {}
    for name, t in model.state_dict().items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # stacked in memory
            e, a, b = t.shape  # transformers holds [E, out, in] (gate|up stacked along out)
            prefix = name.rsplit(".", 1)[0]
            parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            for i in range(e):
                for part in parts:
                    shapes[f"{prefix}.{i}.{part}.weight"] = (a // len(parts), b)
        else:
            shapes[name] = tuple(t.shape)
    return shapes, cfg.to_dict()


def _tensors(shapes: dict[str, tuple[int, ...]], device: str,
             gen: torch.Generator) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=torch.bfloat16)
            continue
        if name.endswith("e_score_correction_bias"):
            yield name, torch.zeros(shape, dtype=torch.float32)
            continue
        w = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, 0.02,
                                                                            generator=gen)
        if QUANTIZED.match(name):
            q, scale = block_quantize(w)
            yield name, q.cpu()
            yield name[: -len("weight")] + "weight_scale_inv", scale.cpu()
        else:
            yield name, w.to(torch.bfloat16).cpu()


def write_checkpoint(config_dir: str, out_dir: str, layers: int | None = None,
                     seed: int = 0) -> dict[str, object]:
    t0 = time.perf_counter()
    out = make(config_dir, out_dir)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    shapes, cfg = _shapes(out, layers)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    if cfg.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)  # the embedding's, as save_pretrained leaves it out
    writer = ShardWriter(out)
    fp8_bytes = 0
    for name, t in _tensors(shapes, device, gen):
        writer.add(name, t)
        fp8_bytes += t.numel() * t.element_size() if t.dtype == FP8 else 0
    writer.close()
    saved = json.loads((out / "config.json").read_text())
    if layers:
        saved["num_hidden_layers"] = layers
        for key in ("layer_types", "mlp_only_layers"):
            if key in cfg and saved.get(key) is not None:
                saved[key] = cfg[key]
    saved["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    return {"out": str(out), "layers": saved["num_hidden_layers"],
            "tensors": len(writer.weight_map), "gib": round(writer.total / 2**30, 2),
            "fp8_gib": round(fp8_bytes / 2**30, 2),
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=None, help="keep only this many layers")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(json.dumps(write_checkpoint(a.config_dir, a.out_dir, a.layers, a.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
