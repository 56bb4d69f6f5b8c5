"""vLLM on bench.prefill's cases: the same prompts (bench.prefill.case_prompts), max_tokens=1, one
untimed run of every case first, median of --repeats; the same FLOP count and JSON keys.

    python -m bench.peer.prefill --model models/configs/Qwen3-8B --cases 8x8192,1x32768 \
        [--max-num-batched-tokens 16384] [--tp 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.peer.engine import add_engine_args, base_record, make_llm
from bench.peer.vllm_env import add_common_args, emit, import_vllm, shutdown_and_exit
from bench.prefill import Case, case_prompts, case_record, parse_cases


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p)
    add_common_args(p)
    p.add_argument("--cases", default="8x8192,1x32768", help="NxL: N prompts of L tokens, ...")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=790.0)
    args = p.parse_args()
    cases = parse_cases(args.cases)
    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab = int(config["vocab_size"])

    vllm = import_vllm(args.vllm_site)
    from vllm import SamplingParams

    llm = make_llm(args, max_model_len=max(c.prompt_len for c in cases) + 16)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)

    def run(case: Case, repeat: int) -> tuple[float, int]:
        prompts = [{"prompt_token_ids": x} for x in case_prompts(case, repeat, vocab)]
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert sum(len(r.prompt_token_ids or []) for r in results) == case.tokens
        return elapsed, sum(r.num_cached_tokens or 0 for r in results)

    for case in cases:  # warm-up, as bench.prefill
        run(case, -1)
    chunk = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    for case in cases:
        timed = [run(case, r) for r in range(args.repeats)]
        emit({**base_record(vllm.__version__, args, "prefill"), "max_num_batched_tokens": chunk,
              **case_record(config, case, [t for t, _ in timed], args.peak_tflops, args.tp),
              "cached_tokens": max(c for _, c in timed)}, args.json)
    shutdown_and_exit(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
