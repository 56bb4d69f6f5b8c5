"""Perplexity of the embedded model on its held-out slice: HF transformers vs our engine.

The slice (tests/model/data/heldout.txt) is the last five books of the training corpus, never
seen in training. Both implementations score the same token windows in fp32; they must agree
to 1e-3 relative, and both must be far below the best possible unigram model of the slice.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from .perplexity import NUM_WINDOWS, WINDOW, nll_sum, unigram_perplexity

# Recorded in models/tiny/MODEL_CARD.md: 40.3 over the whole slice; these 8 windows give ~38.
MAX_EXPECTED_PPL = 60.0


@pytest.fixture(scope="module")
def hf_ppl(tiny_model_path: Path, heldout_windows: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=heldout_windows[:, :-1]).logits
    return math.exp(nll_sum(logits, heldout_windows[:, 1:]) / heldout_windows[:, 1:].numel())


def test_hf_perplexity_far_below_unigram(hf_ppl: float, heldout_ids: list[int]) -> None:
    unigram = unigram_perplexity(heldout_ids)
    assert unigram > 200  # a sane baseline: a 4096-token BPE over English prose
    assert hf_ppl < 0.5 * unigram, (hf_ppl, unigram)
    assert 2.0 < hf_ppl < MAX_EXPECTED_PPL, hf_ppl


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path):
    from minisgl_worker.engine import Engine, EngineConfig

    pages = NUM_WINDOWS * -(-(WINDOW + 1) // 16)  # see engine_logits.pages_for
    eng = Engine(EngineConfig(model_path=str(tiny_model_path), device="cpu", dtype="float32",
                              page_size=16, num_pages=pages, max_slots=NUM_WINDOWS))  # fmt: skip
    yield eng
    eng.close()


def test_engine_perplexity_equals_hf(engine, hf_ppl: float, heldout_windows: torch.Tensor) -> None:
    from .engine_logits import engine_logits

    inputs, targets = heldout_windows[:, :-1], heldout_windows[:, 1:]
    logits = engine_logits(engine, inputs)
    ppl = math.exp(nll_sum(logits, targets) / targets.numel())
    assert abs(ppl - hf_ppl) <= 1e-3 * hf_ppl, (ppl, hf_ppl)

    # The same prefill through the public step API (greedy, with logprobs) must pick the argmax
    # of our last-position logits and report its log-probability: the path above is the engine's.
    from minisgl_core.sampling import SamplingParams

    from .engine_logits import prefill_plan

    plan = prefill_plan(inputs, engine.config.page_size, step_id=1, sample=True)
    for r in plan.reqs:
        r.sampling = SamplingParams(temperature=0.0, max_tokens=1, logprobs=True)
    out = engine.step(plan)
    last = torch.log_softmax(logits[:, -1], dim=-1)
    assert out.token_ids == last.argmax(-1).tolist()
    expected = last.max(-1).values
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4), (out.logprobs, expected)
