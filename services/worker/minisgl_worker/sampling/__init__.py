"""Sampling: one token per row from a step's logits, with per-slot parameters and state.

    sampler.py      `Sampler`, the batched draw the runner calls (and `SampleOutput`)
    params.py       `ParamRow` (one request's values), `SlotParams` (one named array per
                    parameter, views of two packed tables)
    state.py        `SlotState`: parameters, stop ids and output lengths per slot, host and device
    penalties.py    `SlotPenalties`: seen tokens and output counts per slot
    plan.py         `SamplingPlan`: which processors a batch needs, decided on the host
    ops.py          the torch ops: logit processors and the seeded Gumbel-max draw (the Triton
                    kernels are in kernels/sampling.py)
    sharded.py      the TP draw from each rank's vocabulary shard
    logit_bias.py   `SlotBiases`: OpenAI logit_bias
    grammar.py      `SlotGrammars`: structured-output matchers (llguidance); grammar_mask.py
                    applies their token bitmask
    upload.py       host -> device copies without a hidden sync

The package knows no model: it reads logits and slots, and imports only the foundation
(`distributed`, for the TP exchange) and the kernels.
"""

from __future__ import annotations

from .sampler import SampleOutput, Sampler

__all__ = ["SampleOutput", "Sampler"]
