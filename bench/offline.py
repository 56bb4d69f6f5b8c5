"""Offline throughput on nano-vllm's workload through the in-process `LLM` class.

256 sequences, prompt length and ids randint(100, 1024) / randint(0, 10000), output randint(100, 1024)
with ignore_eos — 142,827 input and 133,966 output tokens. Prints output tok/s and the ratio to the
roofline (weights + KV reads per decode step at the measured HBM bandwidth).

    python -m bench.offline --model models/configs/Qwen3-0.6B --load-format dummy
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import jsonl
from bench.common.roofline import ModelShape, measure_hbm_bandwidth, roofline_seconds

EXPECTED_TOKENS = (142_827, 133_966)


def workload(num_seqs: int = 256, max_input: int = 1024, max_output: int = 1024,
             seed: int = 0) -> tuple[list[list[int]], list[int]]:
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input))]
               for _ in range(num_seqs)]
    outputs = [random.randint(100, max_output) for _ in range(num_seqs)]
    return prompts, outputs


class GcPauses:
    """Counts and times the garbage collector's passes while the `with` block runs."""

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.seconds = 0.0
        self._t0 = 0.0

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.passes[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._t0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)


def warm_up_requests() -> tuple[list[list[int]], list[int]]:
    """The warm-up's prompts and max_tokens (bench.peer.offline sends vLLM the same)."""
    prompts, _ = workload(32, seed=1)
    return prompts, [1 + i % 16 for i in range(32)]


def warm_up(llm: Any, temperature: float) -> None:
    """Run 32 other prompts of the workload's shape (no prefix in common with the timed ones):
    JIT-compiled kernel variants that only long prefill chunks and shrinking batches reach would
    otherwise compile inside the timed run (a fresh machine's first run was 5-10 % slower than
    the next)."""
    from minisgl_core.sampling import SamplingParams

    prompts, max_tokens = warm_up_requests()
    llm.generate(prompts, [SamplingParams(temperature=temperature, ignore_eos=True,
                                          max_tokens=n) for n in max_tokens])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model dir (config.json is enough with dummy)")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--decode-attention-backend", default=None, help="hybrid: decode-only steps")
    p.add_argument("--prefill-attention-backend", default=None, help="hybrid: other steps")
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"],
                   help="fp8: KV cache in one byte per element (the roofline reads 1 byte too)")
    p.add_argument("--quantization", default="none", choices=["none", "fp8"],
                   help="fp8: projections, experts as fp8 rows (the roofline reads 1 byte a weight)")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="prompt tokens a step (default: the LLM class's, 16,384)")
    p.add_argument("--disable-overlap", action="store_true")
    p.add_argument("--compare-overlap", action="store_true",
                   help="run twice, overlap off then on, and report both (same outputs checked)")
    p.add_argument("--cache", default="radix", choices=["radix", "naive"])
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="TP: every all-reduce through NCCL (the before of an A/B)")
    p.add_argument("--custom-all-reduce-max-mb", type=int, default=None,
                   help="TP: largest message (MiB) for the custom all-reduce (default: engine's)")
    p.add_argument("--two-shot-max-tokens", type=int, default=None,
                   help="TP: largest step (tokens) of the fused two-shot all-reduce; 0: NCCL")
    p.add_argument("--disable-sharded-sampling", action="store_true",
                   help="TP: gather the full logits for every draw (the before of an A/B)")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--hbm-tbps", type=float, default=None, help="skip measuring; use this TB/s")
    p.add_argument("--tflops", type=float, default=790.0, help="bf16 dense TFLOP/s for prefill")
    p.add_argument("--json", default=None, help="append the result as a JSON line to this file")
    args = p.parse_args()

    prompts, out_lens = workload(args.num_seqs)
    if args.num_seqs == 256:
        assert (sum(map(len, prompts)), sum(out_lens)) == EXPECTED_TOKENS
    runs = [True, False] if args.compare_overlap else [args.disable_overlap]
    records, outputs = [], []
    for disable_overlap in runs:
        args.disable_overlap = disable_overlap
        record, tokens = run_once(args, prompts, out_lens)
        records.append(record)
        outputs.append(tokens)
    if args.compare_overlap and args.temperature == 0:
        assert outputs[0] == outputs[1], "overlap on/off gave different greedy outputs"
    for record in records:
        print(json.dumps(record))
        jsonl.append(args.json, [record])
    return 0


def run_once(args: argparse.Namespace, prompts: list[list[int]],
             out_lens: list[int]) -> tuple[dict, list[list[int]]]:
    from minisgl.llm import LLM
    from minisgl_core.sampling import SamplingParams
    from minisgl_worker.attention import describe

    kwargs = dict(load_format=args.load_format, tp_size=args.tp_size,
                  attention_backend=args.attention_backend, cache=args.cache,
                  disable_overlap=args.disable_overlap, disable_cuda_graph=args.disable_cuda_graph,
                  max_running_requests=args.max_running_requests,
                  kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                  decode_attention_backend=args.decode_attention_backend,
                  prefill_attention_backend=args.prefill_attention_backend)
    if args.page_size:
        kwargs["page_size"] = args.page_size
    if args.max_prefill_tokens:
        kwargs["max_prefill_tokens"] = args.max_prefill_tokens
    if args.disable_custom_all_reduce:  # only when set: older trees (A/B runs) lack the field
        kwargs["disable_custom_all_reduce"] = True
    if args.disable_sharded_sampling:
        kwargs["disable_sharded_sampling"] = True
    if args.custom_all_reduce_max_mb:
        kwargs["custom_all_reduce_max_mb"] = args.custom_all_reduce_max_mb
    if args.two_shot_max_tokens is not None:
        kwargs["two_shot_max_tokens"] = args.two_shot_max_tokens
    llm = LLM(args.model, **kwargs)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
              for n in out_lens]
    warm_up(llm, args.temperature)
    pauses = GcPauses()
    start = time.perf_counter()
    with pauses:
        results = llm.generate(prompts, params, progress=True)  # a bar on a terminal only
    elapsed = time.perf_counter() - start
    produced = sum(len(r["token_ids"]) for r in results)
    assert produced == sum(out_lens), (produced, sum(out_lens))

    import torch

    on_gpu = torch.cuda.is_available()
    bw = args.hbm_tbps * 1e12 if args.hbm_tbps else (measure_hbm_bandwidth() if on_gpu else 0)
    record = {
        "bench": "offline", "engine": "minisgl", "model": Path(args.model).name,
        "tp": args.tp_size, "backend": args.attention_backend,
        "attention": describe(llm.engine.backend),
        "decode_backend": args.decode_attention_backend,
        "max_prefill_tokens": llm.scheduler.config.max_prefill_tokens,  # the LLM's default too
        "overlap": not args.disable_overlap, "cache": args.cache,
        "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization,
        "cuda_graph": not args.disable_cuda_graph,
        "custom_all_reduce": args.tp_size > 1 and not args.disable_custom_all_reduce,
        # None: the engine's default (lamport; --custom-all-reduce-max-mb's default)
        "all_reduce_protocol": os.environ.get("MINISGL_ALL_REDUCE_PROTOCOL"),
        "custom_all_reduce_max_mb": args.custom_all_reduce_max_mb,
        "two_shot_max_tokens": args.two_shot_max_tokens,
        "sharded_sampling": args.tp_size > 1 and not args.disable_sharded_sampling,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "input_tokens": sum(map(len, prompts)), "output_tokens": produced,
        "seconds": round(elapsed, 3), "output_tok_s": round(produced / elapsed, 1),
        # the cyclic collector's passes inside the timed run: how many of each generation and
        # the seconds they held the step loop (host time the GPU may or may not have hidden)
        "gc_passes": pauses.passes, "gc_seconds": round(pauses.seconds, 4),
    }
    if bw:
        shape = ModelShape.from_config(args.model, tp_size=args.tp_size,
                                       kv_dtype_bytes=1 if args.kv_cache_dtype != "auto" else None,
                                       fp8_weights=args.quantization == "fp8")
        floor = roofline_seconds(shape, [len(x) for x in prompts], out_lens, bw,
                                 args.tflops * 1e12)
        record.update({"hbm_tb_s": round(bw / 1e12, 2),
                       "roofline_s": round(floor["total_s"], 3),
                       "roofline_tok_s": round(produced / floor["total_s"], 1),
                       "pct_of_roofline": round(100 * floor["total_s"] / elapsed, 1)})
    llm.close()
    return record, [r["token_ids"] for r in results]


if __name__ == "__main__":
    sys.exit(main())
