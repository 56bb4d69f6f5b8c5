"""Decode attention kernels on one decode step's shape: our Triton split-K kernel over a grid of
launch configs, and FlashInfer's decode (CUDA cores, tensor cores), in bf16 and fp8 KV.

    source bench/gpu_env.sh
    python bench/gpu_tune_decode.py [--heads 16,8] [--batch 256] [--min-len 200 --max-len 2000]

Prints per config the median time of one layer's call (CUDA events) and the effective bandwidth
(KV bytes read / time); the KV lengths are uniform in [min-len, max-len] like the middle of the
offline workload. Only the fastest settings matter; correctness is gpu_check_attention.py's job.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for sub in ("services/worker", "libs/minisgl_core"):
    sys.path.insert(0, str(ROOT / sub))

from gpu_check_attention import time_ms  # noqa: E402  (bench/ is sys.path[0] when run)
from minisgl_worker.kernels import paged_decode as pd  # noqa: E402

DEV = torch.device("cuda")


def time_us(fn: Callable[[], object]) -> float:
    return 1000 * time_ms(fn, iters=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="16,8", help="query heads, KV heads (per rank)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--min-len", type=int, default=200)
    p.add_argument("--max-len", type=int, default=2000)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--splits", default="1,2", help="split counts to sweep (small batches: more)")
    args = p.parse_args()
    hq, hkv = map(int, args.heads.split(","))
    d, ps, bs = args.head_dim, args.page_size, args.batch
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_len, args.max_len + 1, (bs,), generator=gen)
    pages = (-(-lens // ps)).tolist()
    num_pages = sum(pages) + 1
    perm = torch.randperm(num_pages - 1, generator=gen).to(torch.int32)
    table = torch.zeros(bs, max(pages), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[used:used + n]
        used += n
    indptr = torch.tensor([0, *pages]).cumsum(0).to(torch.int32)
    indices = torch.cat([table[i, :n] for i, n in enumerate(pages)]).to(DEV)
    last = ((lens - 1) % ps + 1).to(torch.int32)
    table_d, lens_d = table.to(DEV), lens.to(torch.int32).to(DEV)
    rows = torch.arange(bs, dtype=torch.int32, device=DEV)
    q = torch.randn(bs, hq, d, device=DEV, dtype=torch.bfloat16)
    print(f"device {torch.cuda.get_device_name()}  B={bs} Hq={hq} Hkv={hkv} D={d} ps={ps} "
          f"KV tokens {int(lens.sum())}")
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        shape = (num_pages, ps, hkv, d)
        kc = torch.randn(shape, device=DEV).to(kv_dtype)
        vc = torch.randn(shape, device=DEV).to(kv_dtype)
        kv_bytes = int(lens.sum()) * hkv * d * 2 * kc.element_size()
        name = str(kv_dtype).removeprefix("torch.")
        results = []
        for splits, block_n, warps, stages in itertools.product(
                map(int, args.splits.split(",")), (32, 64, 128), (2, 4, 8), (2, 3)):
            try:
                us = time_us(partial(pd.paged_decode, q, kc, vc, table_d, rows, lens_d,
                                     d ** -0.5, splits, block_n=block_n, num_warps=warps,
                                     num_stages=stages))
            except Exception as exc:  # a config that does not compile (shared memory)
                print(f"  {name} triton s{splits} n{block_n} w{warps} st{stages}: {exc!r:.80}")
                continue
            results.append((us, f"triton splits={splits} block_n={block_n} warps={warps} "
                                f"stages={stages}"))
        try:
            import flashinfer

            ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
            for tc in (False, True):
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
                w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=torch.bfloat16,
                       kv_data_type=kv_dtype, sm_scale=d ** -0.5)
                results.append((time_us(partial(w.run, q, (kc, vc))),
                                f"flashinfer tensor_cores={tc}"))
        except ImportError:
            pass
        results.sort()
        for us, label in results[:12] + [r for r in results[12:] if "flashinfer" in r[1]]:
            print(f"  {name:14s} {us:8.1f} us  {kv_bytes / us / 1e6:6.2f} TB/s  {label}")
        # what the backend launches for this shape (paged_decode's defaults)
        label = (f"triton splits={pd.choose_num_splits(bs, hkv, int(lens.max()))} block_n="
                 f"{pd._BLOCK_N} warps=4 stages={pd._default_stages(DEV, kc.element_size() * d)}")
        default = [r for r in results if r[1] == label]
        if default:
            us = default[0][0]
            print(f"  {name:14s} {us:8.1f} us  {kv_bytes / us / 1e6:6.2f} TB/s  (current default)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
