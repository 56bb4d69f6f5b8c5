"""A synthetic full-size gpt-oss checkpoint in OpenAI's MXFP4 layout, for benchmarks (ours and vLLM's
peer runs) where the real weights cannot be downloaded: the shipped config.json plus a
`quantization_config` {"quant_method": "mxfp4", ...}, the synthetic tokenizer of model_dir.py,
and safetensors shards with random weights under the real tensor names:

  experts  mlp.experts.{gate_up,down}_proj_blocks uint8 (random codes) and _scales uint8 (e8m0
           near 2^-7, so the weights' rms is ~0.02, as a dummy bf16 model's), biases bf16
  the rest bf16 normal(0, 0.02), norms 1 (attention, router, sinks, embeddings, LM head)

Generated on the GPU when there is one (gpt-oss-20b: ~13 GB, a minute or two, mostly disk):

    python -m bench.common.mxfp4_dir models/configs/gpt-oss-20b /tmp/gpt-oss-20b-mxfp4
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from bench.common.model_dir import make

NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                 "lm_head"]
SCALE = 120  # e8m0 byte: 2^-7; random e2m1 codes have rms ~2.9, so the weights' rms is ~0.02
LAYERS_PER_SHARD = 4


def _shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the bf16 model: HF's GptOssForCausalLM built on the meta device."""
    import transformers as tf

    hf_cfg = tf.GptOssConfig(**{k: v for k, v in cfg.items()
                                if k not in ("architectures", "quantization_config")})
    with torch.device("meta"):
        model = tf.GptOssForCausalLM(hf_cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _tensors(name: str, shape: tuple[int, ...], dev: torch.device,
             gen: torch.Generator) -> dict[str, torch.Tensor]:
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        e, k, n = shape  # x @ W [E, K, N]: MXFP4 rows are the N outputs, blocks along K
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, device=dev,
                               generator=gen)
        scales = torch.full((e, n, k // 32), SCALE, dtype=torch.uint8, device=dev)
        return {name + "_blocks": blocks, name + "_scales": scales}
    if name.endswith("norm.weight"):
        return {name: torch.ones(shape, dtype=torch.bfloat16, device=dev)}
    w = torch.empty(shape, dtype=torch.float32, device=dev).normal_(0.0, 0.02, generator=gen)
    return {name: w.bfloat16()}


def write(config_dir: str, out_dir: str, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    out = make(config_dir, out_dir)
    cfg = json.loads((Path(config_dir) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(seed)
    shapes = _shapes(cfg)

    def shard_of(name: str) -> int:
        parts = name.split(".")
        return 1 + int(parts[2]) // LAYERS_PER_SHARD if name.startswith("model.layers.") else 0

    shards = sorted({shard_of(n) for n in shapes})
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            if shard_of(name) == shard:
                tensors.update(_tensors(name, shape, dev, gen))
        save_file({n: t.cpu().contiguous() for n, t in tensors.items()}, str(out / file),
                  metadata={"format": "pt"})
        weight_map.update({n: file for n in tensors})
        print(f"{file}: {len(tensors)} tensors", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    return out


if __name__ == "__main__":
    print(write(sys.argv[1], sys.argv[2]))
