"""Long-prompt prefill through the in-process `LLM`: prefill tokens/s and achieved TFLOP/s.

Each case `NxL` is N prompts of L random token ids (a fresh random stream per prompt and per
repeat, so no two share a prefix and the prefix cache cannot help; the cached-token count is
reported to show it), sent together with max_tokens=1. One untimed run of every case first
(kernel JIT, allocator), then --repeats timed runs a case; the median is reported.

FLOPs a case counts (the JSON's `flops_formula`):
    2 * P * sum(L)                      GEMMs: P = non-embedding parameters a token passes
                                        (attention and MLP projections; MoE: the k routed experts
                                        and the router); embedding lookup and LM head left out
  + sum over sequences 2 * 2 * n_layers * H_q * d * L^2 / 2
                                        attention: QK^T and PV, 2 FLOPs a multiply-add, causal half
`pct_of_peak` = achieved / (--peak-tflops * tp): 790 is the bf16 dense GEMM rate measured on an
H100 (an H200 has the same compute).

    python -m bench.prefill --model models/configs/Qwen3-8B --load-format dummy \
        --cases 8x8192,1x32768 [--max-prefill-tokens 16384] [--tp-size 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import jsonl

FLOPS_FORMULA = ("2*P_nonembedding*sum(L) + sum_seq(2*2*n_layers*H_q*head_dim*L^2/2); "
                 "P_nonembedding: attention + MLP projections a token passes (MoE: k experts + "
                 "router), no embedding, no LM head")


@dataclass(frozen=True)
class Case:
    seqs: int
    prompt_len: int

    @property
    def name(self) -> str:
        return f"{self.seqs}x{self.prompt_len}"

    @property
    def tokens(self) -> int:
        return self.seqs * self.prompt_len


def parse_cases(text: str) -> list[Case]:
    """`8x8192,1x32768` -> [Case(8, 8192), Case(1, 32768)]."""
    cases = []
    for item in text.split(","):
        seqs, _, length = item.strip().lower().partition("x")
        cases.append(Case(int(seqs), int(length)))
    if not cases or any(c.seqs < 1 or c.prompt_len < 1 for c in cases):
        raise ValueError(f"--cases: want NxL[,NxL...] with N, L >= 1, got {text!r}")
    return cases


def case_prompts(case: Case, repeat: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """The case's prompts for one run (repeat -1: the warm-up); both engines send these."""
    top = min(vocab, 30000)
    return [[rng.randrange(10, top) for _ in range(case.prompt_len)]
            for rng in (random.Random(f"{seed}/{case.name}/{repeat}/{i}")
                        for i in range(case.seqs))]


def nonembedding_params(config: dict[str, Any]) -> int:
    """Parameters one token multiplies through, embedding and LM head excluded."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or h // heads
    attn = h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h
    if "num_experts" in config:
        mlp = 3 * h * config["moe_intermediate_size"] * config["num_experts_per_tok"]
        mlp += h * config["num_experts"]  # router
    else:
        mlp = 3 * h * config["intermediate_size"]
    return layers * (attn + mlp)


def prefill_flops(config: dict[str, Any], case: Case) -> dict[str, float]:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    gemm = 2 * nonembedding_params(config) * case.tokens
    attn = case.seqs * 2 * 2 * config["num_hidden_layers"] * heads * head_dim \
        * case.prompt_len ** 2 / 2
    return {"gemm": float(gemm), "attention": float(attn), "total": float(gemm + attn)}


def case_record(config: dict[str, Any], case: Case, seconds: list[float], peak_tflops: float,
                tp: int) -> dict[str, Any]:
    """The figures of one case from its timed runs (shared with bench.peer.prefill)."""
    t = statistics.median(seconds)
    flops = prefill_flops(config, case)
    tflops = flops["total"] / t / 1e12
    return {"case": case.name, "seqs": case.seqs, "prompt_len": case.prompt_len,
            "prompt_tokens": case.tokens, "repeats": len(seconds), "seconds": round(t, 6),
            "prefill_tok_s": round(case.tokens / t, 1),
            "flops": int(flops["total"]), "gemm_flops": int(flops["gemm"]),
            "attention_flops": int(flops["attention"]),
            "tflops": round(tflops, 3), "peak_tflops": peak_tflops,
            "pct_of_peak": round(100 * tflops / (peak_tflops * tp), 2),
            "flops_formula": FLOPS_FORMULA}


def add_case_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", default="8x8192,1x32768", help="NxL: N prompts of L tokens, ...")
    p.add_argument("--repeats", type=int, default=3, help="timed runs a case (median reported)")
    p.add_argument("--peak-tflops", type=float, default=790.0,
                   help="GEMM peak a GPU, TFLOP/s (790: measured H100 bf16)")
    p.add_argument("--json", default=None, help="append one JSON line a case to this file")


def _servable(model: str) -> str:
    """`LLM` reads tokenizer.json: a config-only folder gets a synthetic one in a temp dir."""
    if (Path(model) / "tokenizer.json").is_file():
        return model
    from bench.common.model_dir import make

    return str(make(model, tempfile.mkdtemp(prefix="minisgl-prefill-")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model dir (config.json is enough with dummy)")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--prefill-attention-backend", default=None, help="hybrid: steps with prefill")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="prompt tokens a step computes (the chunk size; longer prompts are "
                        "chunked); default: the LLM class's (16,384)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: config.json's max_position_embeddings")
    p.add_argument("--cache", default="radix", choices=["radix", "naive"])
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--quantization", default="none", choices=["none", "fp8"])
    add_case_args(p)
    args = p.parse_args()
    cases = parse_cases(args.cases)
    config = json.loads((Path(args.model) / "config.json").read_text())

    from minisgl.llm import LLM
    from minisgl_core.sampling import SamplingParams
    from minisgl_worker.attention import describe

    kwargs: dict[str, Any] = dict(load_format=args.load_format, tp_size=args.tp_size,
                                  attention_backend=args.attention_backend, cache=args.cache,
                                  kv_cache_dtype=args.kv_cache_dtype,
                                  quantization=args.quantization,
                                  prefill_attention_backend=args.prefill_attention_backend)
    if args.max_prefill_tokens:
        kwargs["max_prefill_tokens"] = args.max_prefill_tokens
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    llm = LLM(_servable(args.model), **kwargs)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    vocab = int(config["vocab_size"])

    def run(case: Case, repeat: int) -> tuple[float, int]:
        prompts = case_prompts(case, repeat, vocab)
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        assert sum(r["prompt_tokens"] for r in results) == case.tokens
        assert all(len(r["token_ids"]) == 1 for r in results)
        return elapsed, sum(r["cached_tokens"] for r in results)

    for case in cases:  # warm-up: every case once, untimed
        run(case, -1)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    chunk = llm.scheduler.config.max_prefill_tokens  # the one in effect, defaults included
    for case in cases:
        timed = [run(case, r) for r in range(args.repeats)]
        record = {"bench": "prefill", "engine": "minisgl", "model": Path(args.model).name,
                  "tp": args.tp_size, "device": device, "backend": args.attention_backend,
                  "attention": describe(llm.engine.backend),
                  "prefill_backend": args.prefill_attention_backend,
                  "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization,
                  "max_prefill_tokens": chunk, "cache": args.cache,
                  **case_record(config, case, [t for t, _ in timed], args.peak_tflops,
                                args.tp_size),
                  "cached_tokens": max(c for _, c in timed)}
        print(json.dumps(record), flush=True)
        jsonl.append(args.json, [record])
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
