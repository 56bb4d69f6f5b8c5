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

from .perplexity import nll_sum, unigram_perplexity

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
