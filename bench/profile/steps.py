"""Where a decode step's time goes: torch profiler over a steady batch through the in-process `LLM`.

    python -m bench.profile.steps --model /tmp/q06 --attention-backend flashinfer --batch 256

Runs `--batch` requests (prompt `--prompt-len`, `--output-len` tokens each, ignore_eos) once to
warm up and once under the profiler, then prints: wall time, GPU busy time (sum of kernel time)
and the idle share, and the top kernels and host functions. A chrome trace is written when
`--trace` names a file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from bench.common import jsonl


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--quantization", default="none", choices=["none", "fp8"])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--disable-overlap", action="store_true")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--trace", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import torch
    from minisgl.llm import LLM
    from minisgl_core.sampling import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    llm = LLM(args.model, load_format="dummy", attention_backend=args.attention_backend,
              disable_overlap=args.disable_overlap, cache="naive",
              max_running_requests=args.batch, kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization)
    rng = random.Random(0)
    top = min(10000, llm.engine.info().vocab_size - 1)
    prompts = [[rng.randint(0, top) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    params = SamplingParams(temperature=args.temperature, ignore_eos=True,
                            max_tokens=args.output_len)
    llm.generate(prompts, params)  # warm-up
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params)
        sync()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    # Kernels only: an op that launches a kernel (aten::mm, aten::_scaled_mm, cuLaunchKernel)
    # reports that kernel's time as its own "self device time" too, and counting both made the
    # busy time exceed the wall time (an fp8 prefill run: 4.16 s busy in 2.43 s).
    gpu_us = sum(e.self_device_time_total for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    record = {"model": args.model, "backend": args.attention_backend, "batch": args.batch,
              "prompt_len": args.prompt_len, "output_len": args.output_len,
              "overlap": not args.disable_overlap, "wall_s": round(wall, 3),
              "gpu_busy_s": round(gpu_us / 1e6, 3),
              "gpu_idle_pct": round(100 * (1 - gpu_us / 1e6 / wall), 1),
              "decode_tok_s": round(args.batch * args.output_len / wall, 1)}
    print(json.dumps(record))
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    jsonl.append(args.json, [record])
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
