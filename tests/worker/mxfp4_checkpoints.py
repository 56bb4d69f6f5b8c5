"""Tiny gpt-oss checkpoints in the MXFP4 on-disk layout of OpenAI's gpt-oss releases, written by
this file's own code (not the engine's quant/mxfp4.py), so that a layout bug in the engine cannot
hide in a shared helper.

The layout (transformers' integrations/mxfp4.py reads it back the same way):
  mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]   rows = gate_up_proj's columns
  mlp.experts.gate_up_proj_scales  uint8 [E, 2I, H/32]       (gate and up interleaved)
  mlp.experts.down_proj_blocks     uint8 [E, H, I/32, 16]    rows = down_proj's columns
  mlp.experts.down_proj_scales     uint8 [E, H, I/32]
Along a row, block g covers inputs 32g..32g+31; its byte j holds input 32g+2j in bits 0-3 and
32g+2j+1 in bits 4-7; a nibble is sign, 2 exponent bits (bias 1), 1 mantissa bit; a scale byte s
means 2^(s-127). Biases, router, attention, embeddings stay as saved (unquantized).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# magnitude of nibble codes 0..7 (codes 8..15: the same, negated)
MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
CONFIG = {"quant_method": "mxfp4",
          "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                     "model.embed_tokens", "lm_head"]}


def _encode_block(values: torch.Tensor) -> tuple[list[int], int, torch.Tensor]:
    """One block of 32 floats -> (32 nibble codes, scale byte, the values they decode to)."""
    amax = float(values.abs().max())
    # the scale 2^e that brings the largest magnitude into [4, 8): 6 is the largest code
    e = -127 if amax == 0.0 else int(torch.floor(torch.log2(torch.tensor(amax)))) - 2
    e = max(-127, min(127, e))
    codes, decoded = [], []
    for v in values.tolist():
        scaled = min(abs(v) / 2.0 ** e, 6.0)
        best = min(range(8), key=lambda c: (abs(MAGNITUDES[c] - scaled), c))
        sign = 8 if v < 0 and best else 0
        codes.append(best | sign)
        decoded.append((-1.0 if sign else 1.0) * MAGNITUDES[best] * 2.0 ** e)
    return codes, e + 127, torch.tensor(decoded)


def encode_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [E, N, K] -> (blocks [E, N, K/32, 16], scales [E, N, K/32], the decoded W)."""
    e_, n_, k_ = w.shape
    blocks = torch.zeros(e_, n_, k_ // 32, 16, dtype=torch.uint8)
    scales = torch.zeros(e_, n_, k_ // 32, dtype=torch.uint8)
    decoded = torch.zeros(e_, n_, k_)
    for e in range(e_):
        for n in range(n_):
            for g in range(k_ // 32):
                codes, s, dec = _encode_block(w[e, n, 32 * g: 32 * g + 32])
                scales[e, n, g] = s
                decoded[e, n, 32 * g: 32 * g + 32] = dec
                for j in range(16):
                    blocks[e, n, g, j] = codes[2 * j] | (codes[2 * j + 1] << 4)
    return blocks, scales, decoded


def write_mxfp4_checkpoint(src: Path, dst: Path, bf16_layers: tuple[int, ...] = ()) -> dict:
    """Rewrite the save_pretrained checkpoint `src` (a gpt-oss with unquantized experts) at `dst`
    with MXFP4 experts (except the layers in bf16_layers, listed in modules_to_not_convert).
    Returns the state dict HF's GptOssForCausalLM holds for the checkpoint's function: the
    experts dequantized, in fp32."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out, ref = {}, {}
    for name, t in tensors.items():
        ref[name] = t.float()
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if layer in bf16_layers or not name.endswith(("experts.gate_up_proj",
                                                      "experts.down_proj")):
            out[name] = t.contiguous()
            continue
        # gate_up_proj [E, H, 2I] and down_proj [E, I, H] are x @ W: the rows are the columns
        blocks, scales, decoded = encode_rows(t.float().transpose(1, 2).contiguous())
        out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        ref[name] = decoded.transpose(1, 2).contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    qc = dict(CONFIG)
    qc["modules_to_not_convert"] = CONFIG["modules_to_not_convert"] + [
        f"model.layers.{i}.mlp.experts" for i in bf16_layers]
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for extra in src.iterdir():  # generation_config.json and the like
        if extra.is_file() and extra.suffix == ".json" and extra.name != "config.json" and \
                not extra.name.endswith(".index.json"):
            (dst / extra.name).write_bytes(extra.read_bytes())
    return ref
