"""vLLM under the torch profiler on bench.profile.steps' requests: the same JSON fields as ours
(GPU busy, idle share, kernel seconds by kind, top kernels; bench/profile/kernels.py), so where
each engine's time goes can be compared kind by kind in one device call.

    python -m bench.peer.profile --model /tmp/q8 [--workload offline] [--json FILE]

vLLM's engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), or the profiler
would see none of its kernels. The offline workload is profiled with CUDA activity only, as ours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench.peer.engine import add_engine_args, base_record, make_llm
from bench.peer.vllm_env import add_common_args, emit, import_vllm, shutdown_and_exit
from bench.profile.kernels import kernel_times, profiled, report
from bench.profile.steps import add_workload_args, record_of, requests


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p)
    add_common_args(p)
    add_workload_args(p)
    args = p.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM reads its environment
    vllm = import_vllm(args.vllm_site)
    from vllm import SamplingParams

    config = json.loads((Path(args.model) / "config.json").read_text())
    (warm, warm_lens), (prompts, lens) = requests(args, int(config["vocab_size"]))
    offline = args.workload == "offline"
    llm = make_llm(args, max_model_len=4096, enable_prefix_caching=offline)

    def run(batch: list[list[int]], max_tokens: list[int]) -> None:
        llm.generate([{"prompt_token_ids": x} for x in batch],
                     [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
                      for n in max_tokens], use_tqdm=False)

    run(warm, warm_lens)
    events, wall = profiled(lambda: run(prompts, lens), cuda_only=offline)
    fields = report(kernel_times(events), wall, args.rows)
    base = base_record(vllm.__version__, args, "profile")
    emit({**base, **record_of(args, "vllm", {"output_tok_s": round(sum(lens) / wall, 1),
                                             **fields})}, args.json)
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows,
                       max_name_column_width=70))
    shutdown_and_exit(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
