"""GPU microbenchmark of the split-K decode kernel by split count: where one split (the kernel
writes the output itself, no merge) beats split-K plus the merge.

    source bench/gpu_env.sh && python -m bench.micro.decode_splits [--batch 256 128 64 16]
    python -m bench.micro.decode_splits --batch 1 4 --models qwen3-8b qwen3-8b-tp2 --kv bf16 \
        --context 1280

Per case (model heads x batch x KV dtype x splits) it times `paged_decode` as a CUDA graph of
--layers calls (each layer its own KV pool, so the reads come from HBM, not L2) and reports the
median µs a layer call and the K/V bytes read a second. Context lengths follow the offline
workload in mid-run: prompt randint(100, 1024) plus randint(0, 1024) tokens decoded so far; pages
of 64 scattered over the pool. `default` is the split count `choose_num_splits` picks for that
batch. Outputs of every case are checked against the first one's (max |diff| reported; exit
status 1 past 2e-2). One JSON line per case. `--block-n/--num-warps/--num-stages` sweep the
kernel's tile too (every combination with every split count).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys

import torch
from minisgl_worker.kernels.paged_decode import choose_num_splits, paged_decode

from bench.common.gpu_timing import graph_us

# (query heads, KV heads) a GPU: "-tp2" is one rank's share at --tp-size 2.
MODELS = {"qwen3-0.6b": (16, 8), "qwen3-8b": (32, 8), "qwen3-8b-tp2": (16, 4),
          "qwen3-30b-a3b": (32, 4)}
D, PAGE, MAX_MODEL_LEN = 128, 64, 40960


Caches = list[tuple[torch.Tensor, torch.Tensor]]


def make_case(batch: int, hk: int, kv_dtype: torch.dtype, layers: int, seed: int,
              context: int | None = None
              ) -> tuple[list[int], torch.Tensor, Caches, torch.Tensor, torch.Tensor]:
    """`context`: every request holds that many tokens (else the mid-run mix above)."""
    rng = random.Random(seed)
    lens = [context or rng.randint(100, 1024) + rng.randint(0, 1024) for _ in range(batch)]
    pages_per = [-(-n // PAGE) for n in lens]
    num_pages = sum(pages_per) + 1
    perm = torch.randperm(num_pages, device="cuda").to(torch.int32)
    table = torch.zeros(batch, max(pages_per), dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = perm[used:used + n]
        used += n
    shape = (num_pages, PAGE, hk, D)
    caches = [(torch.randn(shape, device="cuda").to(kv_dtype),
               torch.randn(shape, device="cuda").to(kv_dtype)) for _ in range(layers)]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    rows = torch.arange(batch, dtype=torch.int32, device="cuda")
    return lens, table, caches, seq_lens, rows


def time_splits(q: torch.Tensor, caches: Caches,
                table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, splits: int,
                iters: int, tile: dict[str, int] | None = None,
                order: torch.Tensor | None = None) -> tuple[float, torch.Tensor]:
    """(µs a layer call, layer 0's output) with `splits` splits; `tile`: paged_decode's
    block_n / num_warps / num_stages where given (else its defaults); `order`: its start
    order of the requests."""
    batch, hq, _ = q.shape
    ws = (torch.empty(batch, hq, splits, D, device="cuda"),
          torch.empty(batch, hq, splits, device="cuda"))
    outs = [torch.empty_like(q) for _ in caches]

    def layer(i: int) -> None:
        paged_decode(q, caches[i][0], caches[i][1], table, rows, seq_lens, D**-0.5, splits,
                     out=outs[i], workspace=ws, order=order, **(tile or {}))

    us = graph_us(layer, iters, layers=len(caches))
    layer(0)
    return us, outs[0].clone()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[256, 128, 64, 16])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                   help="split counts; 0: the one choose_num_splits picks")
    p.add_argument("--block-n", type=int, nargs="+", default=[None],
                   help="KV tokens a loop step (kernel default where not given)")
    p.add_argument("--num-warps", type=int, nargs="+", default=[None])
    p.add_argument("--num-stages", type=int, nargs="+", default=[None])
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"],
                   choices=list(MODELS))
    p.add_argument("--kv", nargs="+", default=["bf16", "fp8_e4m3"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--order", nargs="+", default=["natural"], choices=["natural", "longest"],
                   help="the requests' start order: as given, or longest first")
    p.add_argument("--context", type=int, default=None,
                   help="KV tokens of every request (e.g. 1280: bench.latency's mid-decode)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_splits: needs a CUDA device", file=sys.stderr)
        return 2
    dtypes = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
    worst = 0.0
    for model in args.models:
        hq, hk = MODELS[model]
        for kv in args.kv:
            for batch in args.batch:
                lens, table, caches, seq_lens, rows = make_case(batch, hk, dtypes[kv],
                                                                args.layers, seed=batch,
                                                                context=args.context)
                q = torch.randn(batch, hq, D, device="cuda", dtype=torch.bfloat16)
                kv_bytes = 2 * sum(lens) * hk * D * caches[0][0].element_size()
                ref = None
                default = choose_num_splits(batch, hk, MAX_MODEL_LEN)
                longest = torch.tensor(sorted(range(batch), key=lambda b: -lens[b]),
                                       dtype=torch.int32, device="cuda")
                for splits, bn, warps, stages, order in itertools.product(
                        args.splits, args.block_n, args.num_warps, args.num_stages,
                        args.order):
                    tile = {k: v for k, v in (("block_n", bn), ("num_warps", warps),
                                              ("num_stages", stages)) if v is not None}
                    splits = splits or default
                    try:
                        us, out = time_splits(q, caches, table, rows, seq_lens, splits,
                                              args.iters, tile,
                                              longest if order == "longest" else None)
                    except Exception as exc:  # a tile past the GPU's shared memory or registers
                        print(json.dumps({"bench": "decode_splits", "model": model, "kv": kv,
                                          "batch": batch, "splits": splits, **tile,
                                          "error": f"{type(exc).__name__}: {exc}"[:200]}))
                        continue
                    ref = out if ref is None else ref
                    diff = (out.float() - ref.float()).abs().max().item()
                    worst = max(worst, diff)
                    print(json.dumps({
                        "bench": "decode_splits", "model": model, "kv": kv, "batch": batch,
                        "splits": splits, "default": default, "order": order, **tile,
                        "us": round(us, 1), "tb_s": round(kv_bytes / us / 1e6, 2),
                        "max_diff_vs_first": round(diff, 5)}), flush=True)
    return 1 if worst > 2e-2 else 0


if __name__ == "__main__":
    sys.exit(main())
