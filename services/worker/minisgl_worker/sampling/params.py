"""Sampling parameters by name: one request's values (`ParamRow`) and a set of slots' values
(`SlotParams`, one named array per parameter).

A `SlotParams` keeps its parameters in two packed tables, `floats` [n, 7] float32 and `ints`
[n, 5] int64, and each parameter is a column view of one of them. Packed because the sampler
moves rows, not parameters: a step uploads the rows that changed in one copy per table, and a
batch's rows are gathered with one index op per table, however many parameters there are. The
names are how every reader addresses a parameter; the column numbers stay in this module.
The views are made when read (properties), so a gathered batch pays only for the columns its
plan or draw reads, as with direct column indexing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch
from minisgl_core.sampling import SamplingParams

# Host tables are torch tensors (pinned copies upload them) read through numpy views (the plan:
# a dozen small torch ops per step would cost more than the draw's launch); device ones are torch.
Array = TypeVar("Array", torch.Tensor, np.ndarray)

NUM_FLOATS, NUM_INTS = 7, 5
# Columns of the tables (the order ParamRow.floats / ints write them in).
(_TEMPERATURE, _TOP_P, _MIN_P, _REPETITION_PENALTY, _PRESENCE_PENALTY, _FREQUENCY_PENALTY,
 _DRAW_TEMPERATURE) = range(NUM_FLOATS)
_TOP_K, _SEED, _MIN_TOKENS, _LOGPROBS, _TOP_LOGPROBS = range(NUM_INTS)


@dataclass(frozen=True, slots=True)
class ParamRow:
    """One request's parameters as the sampler stores them: its seed drawn, `draw_temperature`
    derived. The defaults are an unset slot's (a plain greedy one)."""

    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # The temperature of the fused draw: 0 marks a greedy row, so that one kernel serves a batch
    # mixing greedy and sampled rows (top_k == 1 is greedy whatever the temperature).
    draw_temperature: float = 0.0
    top_k: int = 0  # 0: off
    seed: int = 0
    min_tokens: int = 0
    logprobs: int = 0  # 0 or 1
    top_logprobs: int = 0  # 0 unless logprobs

    @staticmethod
    def of(params: SamplingParams, seed: int) -> ParamRow:
        greedy = params.temperature <= 0 or params.top_k == 1
        return ParamRow(
            temperature=params.temperature, top_p=params.top_p, min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            draw_temperature=0.0 if greedy else params.temperature,
            top_k=params.top_k, seed=seed, min_tokens=params.min_tokens,
            logprobs=int(params.logprobs),
            top_logprobs=params.top_logprobs if params.logprobs else 0)

    def floats(self) -> torch.Tensor:
        """The row of the float table, float32 [NUM_FLOATS], in column order."""
        return torch.tensor([self.temperature, self.top_p, self.min_p, self.repetition_penalty,
                             self.presence_penalty, self.frequency_penalty,
                             self.draw_temperature], dtype=torch.float32)

    def ints(self) -> torch.Tensor:
        """The row of the int table, int64 [NUM_INTS], in column order."""
        return torch.tensor([self.top_k, self.seed, self.min_tokens, self.logprobs,
                             self.top_logprobs], dtype=torch.int64)


@dataclass(frozen=True, slots=True)
class SlotParams(Generic[Array]):
    """The parameters of n slots (or of a batch's rows), each a named [n] view of a table."""

    floats: Array  # [n, NUM_FLOATS] float32
    ints: Array  # [n, NUM_INTS] int64

    @staticmethod
    def neutral(n: int) -> SlotParams[torch.Tensor]:
        """Host tables of n unset slots (`ParamRow()`'s values)."""
        row = ParamRow()
        return SlotParams(row.floats().repeat(n, 1), row.ints().repeat(n, 1))

    def rows(self, index: Array) -> SlotParams[Array]:
        """These rows of every parameter: one gather per table."""
        return SlotParams(self.floats[index], self.ints[index])

    @property
    def temperature(self) -> Array:
        return self.floats[:, _TEMPERATURE]

    @property
    def top_p(self) -> Array:
        return self.floats[:, _TOP_P]

    @property
    def min_p(self) -> Array:
        return self.floats[:, _MIN_P]

    @property
    def repetition_penalty(self) -> Array:
        return self.floats[:, _REPETITION_PENALTY]

    @property
    def presence_penalty(self) -> Array:
        return self.floats[:, _PRESENCE_PENALTY]

    @property
    def frequency_penalty(self) -> Array:
        return self.floats[:, _FREQUENCY_PENALTY]

    @property
    def draw_temperature(self) -> Array:
        return self.floats[:, _DRAW_TEMPERATURE]

    @property
    def top_k(self) -> Array:
        return self.ints[:, _TOP_K]

    @property
    def seed(self) -> Array:
        return self.ints[:, _SEED]

    @property
    def min_tokens(self) -> Array:
        return self.ints[:, _MIN_TOKENS]

    @property
    def logprobs(self) -> Array:
        return self.ints[:, _LOGPROBS]

    @property
    def top_logprobs(self) -> Array:
        return self.ints[:, _TOP_LOGPROBS]
