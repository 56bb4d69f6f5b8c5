"""Perplexity helpers: from next-token logits, and the unigram baseline it must beat."""

from __future__ import annotations

import math
from collections import Counter

import torch

WINDOW = 256  # tokens scored per window
NUM_WINDOWS = 8  # windows spread evenly over the held-out slice


def nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Summed negative log-likelihood of `targets` under fp32 `logits` [..., vocab]."""
    logp = torch.log_softmax(logits.float().reshape(-1, logits.size(-1)), dim=-1)
    return -logp.gather(1, targets.reshape(-1, 1)).sum().item()


def unigram_perplexity(ids: list[int]) -> float:
    """Perplexity of the token frequencies fitted on `ids` itself.

    No unigram model does better on this text, so beating it by a wide margin means the model
    really uses context.
    """
    counts = Counter(ids)
    n = len(ids)
    entropy = -sum(c / n * math.log(c / n) for c in counts.values())
    return math.exp(entropy)
