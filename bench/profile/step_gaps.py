"""GPU busy and idle time per step of the offline workload, from CUDA events around each step.

    source bench/gpu_env.sh && python -m bench.profile.step_gaps --model /tmp/q06 [--kv-cache-dtype fp8_e4m3]

Wraps `Engine.run_step` (what the scheduler's launch calls) with an event recorded before the
step's work is queued and one after: on the GPU's clock, end - start is the step's span (its
kernels, and any gaps inside it while the host was still launching), and the time from one
step's end to the next one's start is idle that overlap scheduling did not hide. Steps are
grouped by kind (prefill only, mixed prefill + decode, decode by batch-size bucket). Unlike the
torch profiler this costs two events a step, so the run keeps its normal speed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from typing import Any

from bench.offline import warm_up, workload


def bucket(num_reqs: int, num_decodes: int, prefill_tokens: int) -> str:
    if prefill_tokens and not num_decodes:
        return "prefill"
    if prefill_tokens:
        return "mixed"
    return f"decode B<={min(256, 1 << max(0, num_reqs - 1).bit_length())}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--quantization", default="none", choices=["none", "fp8"])
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max-prefill-tokens", type=int, default=None)
    p.add_argument("--tp-size", type=int, default=1, help="events on rank 0's GPU")
    args = p.parse_args()

    import torch
    from minisgl.llm import LLM
    from minisgl_core.sampling import SamplingParams

    llm = LLM(args.model, load_format="dummy", max_running_requests=256,
              attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization, tp_size=args.tp_size,
              **({"max_prefill_tokens": args.max_prefill_tokens}
                 if args.max_prefill_tokens else {}))
    prompts, outs = workload(256)
    warm_up(llm, args.temperature)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
              for n in outs]
    engine = llm.engine
    run_step = engine.run_step
    records: list[tuple[Any, Any, str, float]] = []

    def timed_run_step(plan: Any) -> Any:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        inflight = run_step(plan)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        decodes = len(plan.decodes)
        prefill = sum(len(r.input_ids) for r in plan.reqs)
        records.append((start, end, bucket(plan.num_entries, decodes, prefill),
                        time.perf_counter() - t))
        return inflight

    engine.run_step = timed_run_step  # type: ignore[method-assign]
    torch.cuda.synchronize()
    t = time.perf_counter()
    results = llm.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    tokens = sum(len(r["token_ids"]) for r in results)
    print(f"{tokens / wall:.0f} output tok/s, {wall:.3f} s, {len(records)} steps")
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    busy = idle = 0.0
    prev = None
    for start, end, kind, host_s in records:
        span = start.elapsed_time(end) / 1e3
        gap = max(0.0, prev.elapsed_time(start) / 1e3) if prev is not None else 0.0
        prev = end
        g = groups[kind]
        g[0] += 1
        g[1] += span
        g[2] += gap
        g[3] += host_s
        busy += span
        idle += gap
    print(f"GPU spans {busy:.3f} s, idle between steps {idle:.3f} s")
    for kind in sorted(groups):
        n, span, gap, host = groups[kind]
        print(f"{kind:16s} steps {int(n):5d}  span {span:7.3f} s ({span / n * 1e3:6.2f} ms)  "
              f"idle before {gap:6.3f} s ({gap / n * 1e3:5.2f} ms)  host run_step "
              f"{host / n * 1e3:6.2f} ms")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
