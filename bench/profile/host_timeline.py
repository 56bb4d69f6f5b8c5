"""Where the host's time goes in the in-process loop, without the torch profiler's own overhead.

    python -m bench.profile.host_timeline --model /tmp/q06 --attention-backend flashinfer

Runs the offline workload (bench.offline's) through `LLM` with wall-clock timers wrapped
around the scheduler's and the engine's methods, and times how long `collect` waits for the GPU.
With overlap scheduling the host is ahead of the GPU when `collect` waits: the GPU has the next
step queued and never idles. Steps where the wait is ~0 are steps the GPU waited for the host.
Prints each timer's calls, mean and share of the wall time, and the wait's distribution.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import defaultdict
from typing import Any

from bench.common import jsonl
from bench.offline import workload

TOTALS: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(obj: Any, attr: str, label: str) -> None:
    """Replace obj.attr with a wrapper that adds its wall time to TOTALS[label]."""
    fn = getattr(obj, attr)

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            TOTALS[label] += time.perf_counter() - t
            CALLS[label] += 1

    setattr(obj, attr, wrapper)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-output", type=int, default=1024, help="cap output lengths")
    p.add_argument("--disable-overlap", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import torch
    from minisgl.llm import LLM
    from minisgl_core.sampling import SamplingParams

    llm = LLM(args.model, load_format="dummy", attention_backend=args.attention_backend,
              disable_overlap=args.disable_overlap, max_running_requests=256)
    prompts, outs = workload(args.num_seqs)
    outs = [min(n, args.max_output) for n in outs]  # a shorter run for quick checks
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in outs]
    llm.generate(prompts[:8], params[:8])  # warm-up: kernels, graphs, allocator

    sched, engine = llm.scheduler, llm.engine
    waits: list[float] = []
    collect = engine.collect

    def collect_timed() -> Any:
        f = engine._inflight[0] if engine._inflight else None
        t = time.perf_counter()
        if f is not None and f.done is not None:
            f.done.synchronize()
        waits.append(time.perf_counter() - t)
        return collect()

    engine.collect = collect_timed  # type: ignore[method-assign]
    for obj, attr, label in [
        (sched, "step", "scheduler.step (all)"), (sched, "_plan", "scheduler._plan"),
        (sched, "_collect", "scheduler._collect (incl. wait)"),
        (engine, "launch", "engine.launch"), (engine.builder, "validate", "builder.validate"),
        (engine.builder, "build", "builder.build"), (engine, "_forward", "engine._forward"),
        (engine.sampler, "sample", "sampler.sample"), (engine.model, "compute_logits",
                                                        "model.compute_logits"),
        (engine.backend, "prepare", "backend.prepare (eager steps)"),
    ]:
        timed(obj, attr, label)
    if engine.graph_runner is not None:
        timed(engine.backend, "prepare_for_replay", "backend.prepare_for_replay")
    TOTALS.clear()
    CALLS.clear()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(r["token_ids"]) for r in results)
    waits_ms = sorted(w * 1e3 for w in waits)
    n = len(waits_ms)
    starved = sum(1 for w in waits_ms if w < 0.05)
    record = {
        "model": args.model, "backend": args.attention_backend, "overlap": not args.disable_overlap,
        "wall_s": round(wall, 3), "output_tok_s": round(tokens / wall, 1), "steps": n,
        "collect_wait_ms": {"p10": waits_ms[n // 10], "p50": waits_ms[n // 2],
                            "p90": waits_ms[9 * n // 10], "total_s": round(sum(waits) , 3)},
        "steps_without_wait": starved,
        "timers": {k: {"calls": CALLS[k], "mean_us": round(TOTALS[k] / CALLS[k] * 1e6, 1),
                       "share": round(TOTALS[k] / wall, 3)}
                   for k in sorted(TOTALS, key=lambda k: -TOTALS[k]) if CALLS[k]},
    }
    print(json.dumps(record, indent=1))
    jsonl.append(args.json, [record])
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
