"""Where does the serving loop make the host wait for the GPU? torch's sync debug mode, counted.

    python -m bench.profile.find_syncs --model DIR [--kv-cache-dtype fp8_e4m3] [--num-seqs 96]

Runs the offline workload's first `--num-seqs` requests through the in-process `LLM` (after the
same warm-up as bench.offline) with `torch.cuda.set_sync_debug_mode("warn")`, and prints each
synchronizing call site with its count and the stack above it. A site inside a step makes the host
wait for the previous step, which overlap scheduling is there to hide (this found the sampler's
scalar upload: 7 syncs in 96 requests, one per step that admitted requests). The mode is a
prototype in torch and misses some syncs (pageable copies inside extensions, for one).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
import warnings
from pathlib import Path

from bench.offline import warm_up, workload


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--num-seqs", type=int, default=96)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    import torch
    from minisgl.llm import LLM
    from minisgl_core.sampling import SamplingParams

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        print("no CUDA device: running the loop without the sync debug mode", file=sys.stderr)
    llm = LLM(a.model, load_format=a.load_format, kv_cache_dtype=a.kv_cache_dtype)
    try:
        warm_up(llm, 0.6)
        sites: collections.Counter[tuple[str, str]] = collections.Counter()

        def record(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
            stack = traceback.extract_stack()[:-1][-9:]
            where = " <- ".join(f"{f.name}@{Path(f.filename).name}:{f.lineno}"
                                for f in reversed(stack))
            sites[(str(message)[:80], where)] += 1

        prompts, outs = workload(256)
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n)
                  for n in outs[: a.num_seqs]]
        shown = warnings.showwarning
        warnings.showwarning = record
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                if on_gpu:
                    torch.cuda.set_sync_debug_mode("warn")
                t0 = time.perf_counter()
                llm.generate(prompts[: a.num_seqs], params)
                elapsed = time.perf_counter() - t0
                if on_gpu:
                    torch.cuda.set_sync_debug_mode(0)
        finally:
            warnings.showwarning = shown
        print(f"{a.num_seqs} requests in {elapsed:.2f} s; {sum(sites.values())} synchronizing calls")
        for (message, where), count in sites.most_common(a.top):
            print(f"{count:6d}  {message}\n        {where}")
    finally:
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
