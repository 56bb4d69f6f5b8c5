"""A sampling batch's plan: which processors it needs, read from the sampler's host mirror of its
slots' parameters (engine/sampler.py keeps the tables; these are their columns)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Columns of the float / int parameter tables.
_TEMP, _TOP_P, _MIN_P, _REP, _PRES, _FREQ, _DRAW_TEMP = range(7)
_TOP_K, _SEED, _MIN_TOKENS, _LOGPROBS, _TOP_LOGPROBS = range(5)


@dataclass(slots=True)
class _Plan:
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
    def make(hf: np.ndarray, hi: np.ndarray, out_len: np.ndarray, vocab: int) -> _Plan:
        """From the batch's rows of the host mirrors (numpy)."""
        greedy = (hf[:, _TEMP] <= 0) | (hi[:, _TOP_K] == 1)
        sampled = ~greedy
        top_k = np.where(sampled & (hi[:, _TOP_K] > 0), hi[:, _TOP_K], 0)
        return _Plan(
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            repetition=bool((hf[:, _REP] != 1.0).any()),
            presence_frequency=bool(((hf[:, _PRES] != 0) | (hf[:, _FREQ] != 0)).any()),
            min_tokens=bool((out_len < hi[:, _MIN_TOKENS]).any()),
            max_k=min(int(top_k.max()), vocab),
            top_p=bool((sampled & (hf[:, _TOP_P] < 1.0)).any()),
            min_p=bool((sampled & (hf[:, _MIN_P] > 0)).any()),
            logprobs=bool(hi[:, _LOGPROBS].any()),
            top_logprobs=min(int(hi[:, _TOP_LOGPROBS].max()), vocab),
        )
