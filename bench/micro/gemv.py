"""The one-row product of a batch-1 decode step: our Triton GEMV (fused_ops.gemv) against cuBLAS
(F.linear), on the weight shapes of Qwen3 models.

    source bench/gpu_env.sh && python -m bench.micro.gemv [--models qwen3-8b,qwen3-8b-tp2] [--sweep]

Each case is timed as a CUDA graph that cycles through enough copies of the weight (>= 400 MB)
that none of it stays in L2, as in a forward pass where every layer reads its own weights; the
figure is the median of --repeats replays divided by the calls in it, and the bandwidth is the
weight bytes over that time. `down+silu` is the down projection with SiLU-and-mul folded in (its
cuBLAS side includes the separate _silu_mul_kernel launch, which it replaces). `--sweep` also
times a grid of launch configs and prints the fastest, to revisit fused_ops.gemv_config.

Correctness: per case, max |y - ref| / max |ref| against an fp32 product of the same bf16
inputs, for both; exit status 1 if ours is worse than 2x cuBLAS's error plus one bf16 ulp.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from minisgl_worker.kernels import fused_ops

from bench.common import jsonl
from bench.common.gpu_timing import graph_replay_ms

# name -> (hidden, intermediate, q heads, kv heads, head_dim, vocab)
MODELS = {"qwen3-8b": (4096, 12288, 32, 8, 128, 151936),
          "qwen3-0.6b": (1024, 3072, 16, 8, 128, 151936)}
DEV, DTYPE = "cuda", torch.bfloat16


def shapes(model: str) -> dict[str, tuple[int, int]]:
    """Weight [N, K] of each projection. A name ending in "-tpN" (e.g. qwen3-8b-tp2) gives one
    rank's shares at --tp-size N: column-parallel N / tp (qkv, gate_up, the LM head's vocabulary
    block), row-parallel K / tp (o, down)."""
    base, _, tp_part = model.partition("-tp")
    t = int(tp_part) if tp_part else 1
    h, i, hq, hkv, d, vocab = MODELS[base]
    return {"qkv": ((hq + 2 * hkv) * d // t, h), "o": (h, hq * d // t),
            "gate_up": (2 * i // t, h), "down+silu": (h, i // t), "lm_head": (-(-vocab // t), h)}


def graph_us(call: Callable[[torch.Tensor], object], weights: list[torch.Tensor],
             repeats: int) -> float:
    """Median time of one call, from CUDA-graph replays of len(weights) x 10 calls."""

    def body() -> None:
        for _ in range(10):
            for w in weights:
                call(w)

    return graph_replay_ms(body, repeats) * 1e3 / (10 * len(weights))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def run_case(model: str, name: str, n: int, k: int, sweep: bool, repeats: int) -> dict:
    silu = name == "down+silu"
    gen = torch.Generator(device=DEV).manual_seed(0)
    copies = max(2, int(400e6 // (n * k * 2)))
    weights = [(0.02 * torch.randn(n, k, device=DEV, generator=gen)).to(DTYPE)
               for _ in range(copies)]
    x = torch.randn(1, 2 * k if silu else k, device=DEV, generator=gen).to(DTYPE)
    x_in = fused_ops.silu_and_mul(x) if silu else x
    ref = F.linear(x_in.float(), weights[0].float())

    def ours(w: torch.Tensor, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        return fused_ops.gemv(x, w, silu_mul=silu, config=config)

    def cublas(w: torch.Tensor) -> torch.Tensor:
        return F.linear(fused_ops.silu_and_mul(x) if silu else x, w)

    gb = n * k * 2 / 1e9
    rec = {"model": model, "proj": name, "n": n, "k": k,
           "config": list(fused_ops.gemv_config(n, k, silu)),
           "ours_us": round(graph_us(ours, weights, repeats), 2),
           "cublas_us": round(graph_us(cublas, weights, repeats), 2),
           "ours_err": rel_err(ours(weights[0]), ref), "cublas_err": rel_err(cublas(weights[0]), ref)}
    rec["ours_tb_s"] = round(gb / rec["ours_us"] * 1e3, 2)
    rec["cublas_tb_s"] = round(gb / rec["cublas_us"] * 1e3, 2)
    if sweep:
        best = None
        for cfg in itertools.product((1, 2, 4, 8), (512, 1024), (2, 4, 8), (2, 3, 4)):
            if cfg[0] * cfg[1] > 16384 or cfg[1] > max(512, 1 << (k - 1).bit_length()):
                continue
            us = graph_us(lambda w, c=cfg: ours(w, c), weights, repeats)
            if best is None or us < best[0]:
                best = (us, cfg)
        assert best is not None
        rec["sweep_best_us"], rec["sweep_best_config"] = round(best[0], 2), list(best[1])
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-8b,qwen3-0.6b")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ok = True
    for model in args.models.split(","):
        for name, (n, k) in shapes(model).items():
            rec = run_case(model, name, n, k, args.sweep, args.repeats)
            ok &= rec["ours_err"] <= 2 * rec["cublas_err"] + 2 ** -8
            print(json.dumps(rec), flush=True)
            jsonl.append(args.json, [rec])
    print("OK" if ok else "FAIL: a GEMV error beyond cuBLAS's")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
