"""Write a random-weight HF checkpoint (safetensors) for a shipped config.json, with transformers.

    python -m bench.common.dummy_checkpoint models/configs/Qwen3-8B /tmp/q8-ckpt [--layers 8]

`--load-format dummy` draws each TP rank's shard on its own, so TP=1 and TP=N would run different
weights. Checks that compare them (tests/gpu/test_tp.py) load this checkpoint instead: the same
full tensors, sliced per rank by the real loader. The tokenizer is bench.common.model_dir's synthetic
one. The weights are built on the GPU when there is one (fast), in bf16.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.common.model_dir import make


def write_checkpoint(config_dir: str, out_dir: str, layers: int | None = None,
                     seed: int = 0) -> dict[str, object]:
    """Write the checkpoint; returns the summary main() prints."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = make(config_dir, out_dir)
    cfg = AutoConfig.from_pretrained(out)
    if layers:
        cfg.num_hidden_layers = layers
        if hasattr(cfg, "layer_types") and cfg.layer_types:
            cfg.layer_types = cfg.layer_types[:layers]
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="4GB")
    saved = json.loads((out / "config.json").read_text())
    return {"out": str(out), "layers": saved["num_hidden_layers"],
            "params": sum(p.numel() for p in model.parameters()),
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
