"""Where an engine step's time goes: torch profiler over a workload through the in-process `LLM`.

    python -m bench.profile.steps --model /tmp/q06 --attention-backend flashinfer --batch 256
    python -m bench.profile.steps --model /tmp/q8 --workload offline      # bench.offline's requests

`--workload steady` (default) runs `--batch` requests (prompt `--prompt-len`, `--output-len` tokens
each, ignore_eos) once to warm up and once under the profiler; `--workload offline` runs
bench.offline's warm-up and then its 256 requests under the profiler (CUDA activity only, to keep
the profiler's cost down). Prints one JSON line (wall time, GPU busy time and idle share, kernel
seconds by kind and the top kernels: bench/profile/kernels.py), then the profiler's tables.
`bench.peer.profile` runs vLLM on the same requests and prints the same fields, so the two can be
read side by side. A chrome trace is written when `--trace` names a file; `--gaps` adds where
the GPU idles, gap by gap (bench/profile/gaps.py). The line's `host_stalls` counts this process's
garbage collections, Triton compiles and allocator slow paths in the timed run (profile.stalls).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from bench.common import jsonl
from bench.profile.kernels import kernel_times, profiled, report
from bench.profile.stalls import host_stalls


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags bench.peer.profile shares."""
    p.add_argument("--workload", default="steady", choices=["steady", "offline"])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--rows", type=int, default=25)


Requests = tuple[list[list[int]], list[int]]  # (prompts, max_tokens)


def requests(args: argparse.Namespace, vocab_size: int) -> tuple[Requests, Requests]:
    """(warm-up, timed) as (prompts, max_tokens): steady batches or bench.offline's workload."""
    if args.workload == "offline":
        from bench.offline import warm_up_requests, workload

        return warm_up_requests(), workload(256)
    rng = random.Random(0)
    top = min(10000, vocab_size - 1)
    prompts = [[rng.randint(0, top) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    lens = [args.output_len] * args.batch
    return (prompts, lens), (prompts, lens)


def record_of(args: argparse.Namespace, engine: str, fields: dict[str, Any]) -> dict[str, Any]:
    steady = args.workload == "steady"
    return {"bench": "profile", "engine": engine, "model": Path(args.model).name,
            "workload": args.workload, "batch": args.batch if steady else None,
            "prompt_len": args.prompt_len if steady else None,
            "output_len": args.output_len if steady else None, **fields}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--quantization", default="none", choices=["none", "fp8"])
    p.add_argument("--disable-overlap", action="store_true")
    p.add_argument("--tp-size", type=int, default=1,
                   help="TP>1: rank 0's kernels (this process); the other ranks mirror them")
    p.add_argument("--trace", default=None)
    p.add_argument("--gaps", action="store_true",
                   help="also where the GPU idles: gaps by neighbouring kernels (profile.gaps)")
    p.add_argument("--json", default=None)
    add_workload_args(p)
    args = p.parse_args()

    from minisgl.llm import LLM
    from minisgl_core.sampling import SamplingParams

    offline = args.workload == "offline"
    llm = LLM(args.model, load_format="dummy", attention_backend=args.attention_backend,
              disable_overlap=args.disable_overlap, cache="radix" if offline else "naive",
              max_running_requests=256 if offline else args.batch,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
              tp_size=args.tp_size)
    (warm, warm_lens), (prompts, lens) = requests(args, llm.engine.info().vocab_size)

    def params(max_tokens: list[int]) -> list[SamplingParams]:
        return [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
                for n in max_tokens]

    llm.generate(warm, params(warm_lens))
    raw: list[Any] | None = [] if args.gaps else None
    stalls: dict[str, Any] = {}

    def run() -> None:
        with host_stalls(stalls):  # the run only: not the profiler's own processing after it
            llm.generate(prompts, params(lens))

    events, wall = profiled(run, cuda_only=offline, trace=args.trace, raw=raw)
    fields = report(kernel_times(events), wall, args.rows)
    fields["host_stalls"] = stalls
    if raw is not None:
        from bench.profile.gaps import device_activities, idle_gaps

        fields["gaps"] = idle_gaps(device_activities(raw), wall, args.rows)
    record = record_of(args, "minisgl", {
        "tp": args.tp_size, "backend": args.attention_backend,
        "overlap": not args.disable_overlap,
        "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization,
        "output_tok_s": round(sum(lens) / wall, 1), **fields})
    print(json.dumps(record))
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows,
                       max_name_column_width=70))
    if not offline:
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows,
                           max_name_column_width=70))
    jsonl.append(args.json, [record])
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
