"""Next-token logits at every position of a batch of sequences, from our worker engine.

The engine's public step API returns sampled tokens (and the log-probability of the sampled one)
at the last position only; perplexity needs every position. So this runs one prefill step
through the engine's own machinery, minus the sampler: the plan is validated and built by the
engine's PlanBuilder, the KV pages are written through its page table, and the hidden states
come from `Engine._forward` (paged attention backend + the model the engine loaded) and
`model.compute_logits`. The test cross-checks the last position against the public `step()`.
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


@torch.inference_mode()
def engine_logits(engine, seqs: torch.Tensor) -> torch.Tensor:
    """seqs int64 [B, T] -> fp32 logits [B, T, vocab] (row t predicts token t + 1)."""
    plan = prefill_plan(seqs, engine.config.page_size, step_id=0, sample=False)
    engine.builder.validate(plan)
    step, writes = engine.builder.build(plan)
    w = torch.from_numpy(writes).to(engine.device)
    engine.pool.page_table[w[0], w[1]] = w[2].int()
    hidden = engine._forward(step)
    logits = engine.model.compute_logits(hidden).float()
    return logits.reshape(seqs.shape[0], seqs.shape[1], -1).cpu()
