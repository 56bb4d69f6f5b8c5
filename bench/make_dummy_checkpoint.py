"""Write a random-weight HF checkpoint (safetensors) for a shipped config.json, with transformers.

    python bench/make_dummy_checkpoint.py models/configs/Qwen3-8B /tmp/q8-ckpt [--layers 8]

`--load-format dummy` draws each TP rank's shard on its own, so TP=1 and TP=N would run different
weights. Checks that compare them (bench/gpu_check_tp.py) load this checkpoint instead: the same
full tensors, sliced per rank by the real loader. The tokenizer is bench_model_dir.py's synthetic
one. The weights are built on the GPU when there is one (fast), in bf16.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model_dir import make  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=None, help="keep only this many layers")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    out = make(a.config_dir, a.out_dir)
    cfg = AutoConfig.from_pretrained(out)
    if a.layers:
        cfg.num_hidden_layers = a.layers
        if hasattr(cfg, "layer_types") and cfg.layer_types:
            cfg.layer_types = cfg.layer_types[: a.layers]
    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="4GB")
    saved = json.loads((out / "config.json").read_text())
    print(json.dumps({"out": str(out), "layers": saved["num_hidden_layers"],
                      "params": sum(p.numel() for p in model.parameters()),
                      "seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
