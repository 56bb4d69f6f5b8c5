"""A sampling batch's plan: which processors it needs, read on the host from its slots'
parameters (the numpy mirror of `SlotState.host`), so a batch without top-p never sorts and one
without penalties never reads the count tensors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .params import SlotParams


@dataclass(slots=True)
class SamplingPlan:
    """Which processors this batch needs, from the host mirror of its slots."""

    all_greedy: bool
    any_greedy: bool
    repetition: bool
    presence_frequency: bool
    min_tokens: bool
    max_k: int  # 0: no sampled row uses top-k
    top_p: bool
    min_p: bool
    logprobs: bool
    top_logprobs: int

    @property
    def fused(self) -> bool:
        """Only greedy and temperature-only rows: one pass over the logits as they come."""
        return not (self.repetition or self.presence_frequency or self.min_tokens or self.max_k
                    or self.top_p or self.min_p or self.logprobs)

    @staticmethod
    def make(p: SlotParams[np.ndarray], out_len: np.ndarray, vocab: int) -> SamplingPlan:
        """From the batch's rows of the host mirror (numpy) and their output lengths so far."""
        top_k = p.top_k
        greedy = (p.temperature <= 0) | (top_k == 1)
        sampled = ~greedy
        sampled_k = np.where(sampled & (top_k > 0), top_k, 0)
        return SamplingPlan(
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            repetition=bool((p.repetition_penalty != 1.0).any()),
            presence_frequency=bool(((p.presence_penalty != 0)
                                     | (p.frequency_penalty != 0)).any()),
            min_tokens=bool((out_len < p.min_tokens).any()),
            max_k=min(int(sampled_k.max()), vocab),
            top_p=bool((sampled & (p.top_p < 1.0)).any()),
            min_p=bool((sampled & (p.min_p > 0)).any()),
            logprobs=bool(p.logprobs.any()),
            top_logprobs=min(int(p.top_logprobs.max()), vocab),
        )
