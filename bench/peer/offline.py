"""vLLM on bench.offline's workload (nano-vllm's: 256 sequences, 142,827 in / 133,966 out tokens),
with bench.offline's warm-up, timed over one `generate`: output tok/s.

    python -m bench.peer.offline --model /tmp/q8 [--kv-cache-dtype fp8] [--quantization fp8] \
        [--tp 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.offline import EXPECTED_TOKENS, warm_up_requests, workload
from bench.peer.engine import add_engine_args, base_record, make_llm
from bench.peer.vllm_env import add_common_args, emit, import_vllm, shutdown_and_exit


def _params(sampling_params: type, temperature: float, lens: list[int]) -> list[object]:
    return [sampling_params(temperature=temperature, ignore_eos=True, max_tokens=n) for n in lens]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p)
    add_common_args(p)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.6)
    args = p.parse_args()

    prompts, out_lens = workload(args.num_seqs)
    if args.num_seqs == 256:
        assert (sum(map(len, prompts)), sum(out_lens)) == EXPECTED_TOKENS
    vllm = import_vllm(args.vllm_site)
    from vllm import SamplingParams

    start = time.perf_counter()
    llm = make_llm(args, max_model_len=4096)
    init_s = time.perf_counter() - start
    warm, warm_lens = warm_up_requests()  # bench.offline.warm_up's requests
    llm.generate([{"prompt_token_ids": x} for x in warm],
                 _params(SamplingParams, args.temperature, warm_lens), use_tqdm=False)
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": x} for x in prompts],
                           _params(SamplingParams, args.temperature, out_lens), use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    assert produced == sum(out_lens), (produced, sum(out_lens))
    sched = llm.llm_engine.vllm_config.scheduler_config
    emit({**base_record(vllm.__version__, args, "offline"),
          "max_num_batched_tokens": sched.max_num_batched_tokens,
          "input_tokens": sum(map(len, prompts)), "output_tokens": produced,
          "seconds": round(elapsed, 3), "output_tok_s": round(produced / elapsed, 1),
          "init_s": round(init_s, 1)}, args.json)
    shutdown_and_exit(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
