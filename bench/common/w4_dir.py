"""Write a synthetic 4-bit checkpoint (GPTQ or AWQ layout) at a shipped config's real shapes, for
benchmarks: every attention / MLP projection (and per-expert MoE projection) stored as the
publisher's tools store it, random 4-bit codes with small group scales; embeddings, norms, the
router and the LM head in bf16. Both engines load the same folder (bench.peer: --load-format
safetensors). Built on the GPU when there is one, written in ~4 GB shards.

    python -m bench.common.w4_dir models/configs/Qwen3-8B /tmp/q8-gptq gptq [--group-size 128]

Layouts (4-bit, N outputs, K inputs, groups of G along K):
  gptq  qweight int32 [K/8, N] packed along K (nibble j of word i = row 8i + j), qzeros int32
        [K/G, N/8] packed along N, stored minus one (checkpoint_format "gptq"), scales fp16
        [K/G, N], g_idx int32 [K] = k // G (no act-order)
  awq   qweight int32 [K, N/8] and qzeros [K/G, N/8] packed along N in AWQ's order (nibble i of
        word c = column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]), scales fp16 [K/G, N] (version "gemm")
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import torch

from bench.common.model_dir import make
from bench.common.shards import ShardWriter

PROJ = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack(q: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int codes 0..15 -> int32 words of 8 along `dim`; nibble i holds element order[i]."""
    q = q.to(torch.int64).movedim(dim, -1)
    q = q.reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    word = torch.zeros(q.shape[:-1], dtype=torch.int64, device=q.device)
    for i, src in enumerate(order):
        word |= q[..., src] << (4 * i)
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()


def quantized(name: str, n: int, k: int, fmt: str, g: int, gen: torch.Generator,
              device: str) -> dict[str, torch.Tensor]:
    base = name[: -len(".weight")]
    q = torch.randint(0, 16, (k, n), generator=gen, device=device)  # [K, N]
    z = torch.full((k // g, n), 8, device=device)  # symmetric codes around 8
    s = (torch.rand(k // g, n, generator=gen, device=device) * 0.002 + 0.001).half()
    if fmt == "gptq":
        return {f"{base}.qweight": _pack(q, 0), f"{base}.qzeros": _pack(z - 1, 1),
                f"{base}.scales": s,
                f"{base}.g_idx": (torch.arange(k, device=device) // g).to(torch.int32)}
    return {f"{base}.qweight": _pack(q, 1, AWQ_ORDER), f"{base}.qzeros": _pack(z, 1, AWQ_ORDER),
            f"{base}.scales": s}


def quant_config(fmt: str, g: int) -> dict[str, object]:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": False,
                "sym": True, "checkpoint_format": "gptq"}
    return {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True,
            "version": "gemm"}


def write(config_dir: str, out_dir: str, fmt: str, group_size: int = 128,
          seed: int = 0) -> dict[str, object]:
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    out = make(config_dir, out_dir)
    cfg = AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    writer = ShardWriter(out)
    count = 0
    for name, p in meta.named_parameters():
        if PROJ.search(name) and p.dim() == 2:
            n, k = p.shape
            tensors = quantized(name, n, k, fmt, group_size, gen, device)
            count += 1
        elif name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            # transformers holds the experts fused [E, N, K]; checkpoints store them per expert
            experts, n, k = p.shape
            parts = ((("gate_proj", n // 2), ("up_proj", n // 2)) if "gate_up" in name
                     else (("down_proj", n),))
            tensors = {}
            for e in range(experts):
                for proj, rows in parts:
                    tensors.update(quantized(f"{name.rsplit('.', 1)[0]}.{e}.{proj}.weight",
                                             rows, k, fmt, group_size, gen, device))
                    count += 1
        elif name.endswith("norm.weight") or "layernorm" in name:
            tensors = {name: torch.ones(p.shape, dtype=torch.bfloat16, device=device)}
        else:
            t = torch.randn(p.shape, generator=gen, device=device) * 0.02
            tensors = {name: t.bfloat16()}
        for key, t in tensors.items():
            writer.add(key, t)
    writer.close()
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = quant_config(fmt, group_size)
    raw["torch_dtype"] = "bfloat16"  # both engines run bf16 activations
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return {"out": str(out), "format": fmt, "group_size": group_size, "projections": count,
            "shards": writer.shards, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config_dir")
    ap.add_argument("out_dir")
    ap.add_argument("format", choices=["gptq", "awq"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(json.dumps(write(a.config_dir, a.out_dir, a.format, a.group_size, a.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
