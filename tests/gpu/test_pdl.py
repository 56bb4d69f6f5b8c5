"""Programmatic dependent launch (triton_kernels/pdl.py) changes when kernels start, never what
they compute: greedy outputs with PDL must equal those with MINISGL_DISABLE_PDL=1 token for
token, at batch 1 (GEMV path) and in a batch (cuBLAS GEMMs between our kernels), from CUDA
graphs and eager. A missing wait would read a buffer before it is written and show up here.

    make test-gpu                        # as a pytest test (Qwen3-0.6B, bf16 and fp8), or:
    PYTHONPATH=tests:$PYTHONPATH python3 -m gpu.test_pdl --model DIR [--quantization fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import pytest


def run(args: argparse.Namespace, pdl: bool, graphs: bool) -> list[list[int]]:
    from minisgl.llm import LLM
    from minisgl_core.sampling import SamplingParams

    os.environ["MINISGL_DISABLE_PDL"] = "0" if pdl else "1"
    llm = LLM(args.model, load_format="dummy", cache="naive", quantization=args.quantization,
              disable_cuda_graph=not graphs)
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(16, 600))] for _ in range(9)]
    params = dict(temperature=0.0, ignore_eos=True, max_tokens=args.tokens)
    try:
        outs = [llm.generate([prompts[0]], SamplingParams(**params))[0]["token_ids"]]  # batch 1
        outs += [r["token_ids"] for r in llm.generate(prompts[1:], SamplingParams(**params))]
    finally:
        llm.close()
    return outs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--quantization", default="none", choices=["none", "fp8"])
    p.add_argument("--tokens", type=int, default=96)
    args = p.parse_args(argv)
    ok = True
    for graphs in (True, False):
        on, off = run(args, True, graphs), run(args, False, graphs)
        equal = [a == b for a, b in zip(on, off, strict=True)]
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                           None) for a, b in zip(on, off, strict=True)]
        ok &= all(equal)
        print(json.dumps({"cuda_graphs": graphs, "quantization": args.quantization,
                          "batch1_equal": equal[0], "batch8_equal": sum(equal[1:]),
                          "first_diff": first_diff, "ok": all(equal)}), flush=True)
    return 0 if ok else 1


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_pdl_changes_no_token(qwen3_06b: Path, quantization: str) -> None:
    assert main(["--model", str(qwen3_06b), "--quantization", quantization]) == 0


if __name__ == "__main__":
    sys.exit(main())
