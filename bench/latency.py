"""Single-request latency through the in-process `LLM`: TTFT for a 1k-token prompt, bs=1 decode tok/s.

    python -m bench.latency --model models/configs/Qwen3-8B --load-format dummy
Roofline for bs=1 decode: all weights read once per token, at the measured HBM bandwidth.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from bench.common import jsonl
from bench.common.roofline import ModelShape, measure_hbm_bandwidth


def latency_prompt(prompt_len: int) -> list[int]:
    """The one prompt every request sends (bench.peer.latency sends vLLM the same)."""
    rng = random.Random(0)
    return [rng.randint(0, 10000) for _ in range(prompt_len)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="TP: every all-reduce through NCCL (the before of an A/B)")
    p.add_argument("--disable-sharded-sampling", action="store_true",
                   help="TP: gather the full logits for every draw (the before of an A/B)")
    p.add_argument("--quantization", default="none", choices=["none", "fp8"])
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from minisgl.llm import LLM
    from minisgl_core.sampling import SamplingParams
    from minisgl_worker.attention import describe

    # Only when set: older trees (A/B runs) lack the fields.
    extra = {"disable_custom_all_reduce": True} if args.disable_custom_all_reduce else {}
    if args.disable_sharded_sampling:
        extra["disable_sharded_sampling"] = True
    llm = LLM(args.model, load_format=args.load_format, tp_size=args.tp_size,
              attention_backend=args.attention_backend,
              disable_cuda_graph=args.disable_cuda_graph, cache="naive",
              quantization=args.quantization, **extra)
    prompt = latency_prompt(args.prompt_len)
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=4, **greedy))  # warm-up
    ttfts, decode_rates = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, **greedy))
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=args.decode_tokens, **greedy))
        total = time.perf_counter() - start
        ttfts.append(ttft)
        decode_rates.append((args.decode_tokens - 1) / max(1e-9, total - ttft))

    import torch

    record = {"bench": "latency", "engine": "minisgl", "model": Path(args.model).name,
              "tp": args.tp_size, "backend": args.attention_backend,
              "attention": describe(llm.engine.backend),
              "cuda_graph": not args.disable_cuda_graph,
              "custom_all_reduce": args.tp_size > 1 and not args.disable_custom_all_reduce,
              "sharded_sampling": args.tp_size > 1 and not args.disable_sharded_sampling,
              "quantization": args.quantization,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "ttft_ms_1k": round(1000 * statistics.median(ttfts), 2),
              "decode_tok_s_bs1": round(statistics.median(decode_rates), 1)}
    if torch.cuda.is_available():
        bw = measure_hbm_bandwidth()
        floor = ModelShape.from_config(args.model, tp_size=args.tp_size,
                                       fp8_weights=args.quantization == "fp8").weight_bytes / bw
        record.update({"hbm_tb_s": round(bw / 1e12, 2), "roofline_tok_s": round(1 / floor, 1),
                       "pct_of_roofline": round(100 * record["decode_tok_s_bs1"] * floor, 1)})
    print(json.dumps(record))
    jsonl.append(args.json, [record])
    return 0


if __name__ == "__main__":
    sys.exit(main())
