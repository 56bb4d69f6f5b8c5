"""Next-token logits at every position of a batch of sequences, from our worker engine.

`Engine.step()` samples at the last position only; perplexity needs every position, which
`Engine.forward_logits(plan)` returns: the same plan validation, paged KV writes, attention
backend and model as a step, minus the sampler. The test cross-checks the last position against
the public `step()`.
"""

from __future__ import annotations

import torch
from minisgl_core.step import ReqPlan, StepPlan


def pages_for(slot: int, n_tokens: int, page_size: int) -> list[int]:
    """A disjoint run of page ids per slot, enough for n_tokens."""
    n = -(-n_tokens // page_size)
    return list(range(slot * n, slot * n + n))


def prefill_plan(seqs: torch.Tensor, page_size: int, step_id: int, sample: bool) -> StepPlan:
    reqs = [
        ReqPlan(rid=i, slot=i, cache_len=0, input_ids=seq.tolist(),
                new_pages=pages_for(i, seqs.shape[1] + 1, page_size), sample=sample)
        for i, seq in enumerate(seqs)
    ]  # fmt: skip
    return StepPlan(step_id=step_id, reqs=reqs)


def engine_logits(engine, seqs: torch.Tensor) -> torch.Tensor:
    """seqs int64 [B, T] -> fp32 logits [B, T, vocab] (row t predicts token t + 1)."""
    plan = prefill_plan(seqs, engine.config.page_size, step_id=0, sample=False)
    logits = engine.forward_logits(plan).float()
    return logits.reshape(seqs.shape[0], seqs.shape[1], -1).cpu()
