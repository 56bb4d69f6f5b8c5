"""vLLM at batch 1, as bench.latency measures ours: the same prompt (bench.latency.latency_prompt),
greedy, ignore_eos, prefix caching off (ours runs `cache="naive"`; a cached prompt would make
TTFT a lookup); per repeat TTFT = one max_tokens=1 request, decode tok/s = (N-1) / (time of an
N-token request - TTFT); medians over --repeats.

    python -m bench.peer.latency --model /tmp/q8 [--tp 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.latency import latency_prompt
from bench.peer.engine import add_engine_args, base_record, make_llm
from bench.peer.vllm_env import add_common_args, emit, import_vllm, shutdown_and_exit


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p)
    add_common_args(p)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    vllm = import_vllm(args.vllm_site)
    from vllm import SamplingParams

    llm = make_llm(args, max_model_len=args.prompt_len + args.decode_tokens + 16,
                   enable_prefix_caching=False)
    prompt = [{"prompt_token_ids": latency_prompt(args.prompt_len)}]

    def run(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - start

    run(4)  # warm-up, as bench.latency
    ttfts, rates = [], []
    for _ in range(args.repeats):
        ttft = run(1)
        total = run(args.decode_tokens)
        ttfts.append(ttft)
        rates.append((args.decode_tokens - 1) / max(1e-9, total - ttft))
    emit({**base_record(vllm.__version__, args, "latency"),
          "ttft_ms_1k": round(1000 * statistics.median(ttfts), 2),
          "decode_tok_s_bs1": round(statistics.median(rates), 1)}, args.json)
    shutdown_and_exit(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
