"""Penalty state per slot: which tokens a request has seen (prompt and output, for the HF
repetition penalty) and how often it produced each (output only, for the OpenAI presence and
frequency penalties).

The [max_slots, V] tables are allocated when a request first uses them (large for big
vocabularies). Tokens fed to a slot are queued on the host and written by `flush` in one
index_put per table a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from minisgl_core.sampling import SamplingParams

from .upload import upload

NO_PROMPT_END = 2**62  # `prompt_len` of a slot whose every position is prompt


class SlotPenalties:
    def __init__(self, max_slots: int, vocab_size: int, device: torch.device) -> None:
        self.max_slots, self.vocab_size, self.device = max_slots, vocab_size, device
        self.seen: torch.Tensor | None = None  # bool: prompt + output tokens (repetition)
        self.counts: torch.Tensor | None = None  # int32: output token counts (presence/freq)
        self.rep_slots: set[int] = set()  # slots whose request uses the repetition penalty
        self.count_slots: set[int] = set()  # slots whose request uses presence/frequency
        self.prompt_len: dict[int, int] = {}  # positions from here on are outputs
        self._pending_seen: dict[int, list[int]] = {}
        self._pending_counts: dict[int, list[int]] = {}

    def set_slot(self, slot: int, params: SamplingParams, prompt_len: int) -> None:
        """A request (re)starts in `slot`: nothing queued for the slot's old request survives;
        its rows of the tables are cleared by `reset` in the next flush."""
        self._pending_seen.pop(slot, None)
        self._pending_counts.pop(slot, None)
        self.rep_slots.discard(slot)
        self.count_slots.discard(slot)
        self.prompt_len[slot] = prompt_len
        if params.repetition_penalty != 1.0:
            self.rep_slots.add(slot)
            if self.seen is None:
                self.seen = torch.zeros(self.max_slots, self.vocab_size, dtype=torch.bool,
                                        device=self.device)
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            self.count_slots.add(slot)
            if self.counts is None:
                self.counts = torch.zeros(self.max_slots, self.vocab_size, dtype=torch.int32,
                                          device=self.device)

    def tracks(self, slot: int) -> bool:
        """Whether `slot`'s request uses a penalty (so its inputs must be observed)."""
        return slot in self.rep_slots or slot in self.count_slots

    def observe(self, slot: int, token_ids: Sequence[int], start_pos: int) -> None:
        """Tokens fed to a tracked `slot`, the first at position `start_pos` (ids checked)."""
        if slot in self.rep_slots:
            self._pending_seen.setdefault(slot, []).extend(token_ids)
        outputs = token_ids[max(0, self.prompt_len.get(slot, NO_PROMPT_END) - start_pos):]
        if slot in self.count_slots and outputs:
            self._pending_counts.setdefault(slot, []).extend(outputs)

    def reset(self, idx: torch.Tensor) -> None:
        """Clear the rows of these slots (device indices): their requests start afresh."""
        if self.seen is not None:
            self.seen.index_fill_(0, idx, False)
        if self.counts is not None:
            self.counts.index_fill_(0, idx, 0)

    def flush(self) -> None:
        """Write the queued tokens into the tables."""
        if self._pending_seen:
            assert self.seen is not None
            rows = [s for s, ids in self._pending_seen.items() for _ in ids]
            cols = [t for ids in self._pending_seen.values() for t in ids]
            index = upload(torch.tensor([rows, cols], dtype=torch.int64), self.device)
            self.seen.index_put_((index[0], index[1]),  # not `= True`: a blocking upload
                                 torch.ones(len(rows), dtype=torch.bool, device=self.device))
            self._pending_seen.clear()
        if self._pending_counts:
            assert self.counts is not None
            rows = [s for s, ids in self._pending_counts.items() for _ in ids]
            cols = [t for ids in self._pending_counts.values() for t in ids]
            index = upload(torch.tensor([rows, cols], dtype=torch.int64), self.device)
            self.counts.index_put_((index[0], index[1]),
                                   torch.ones(len(rows), dtype=torch.int32, device=self.device),
                                   accumulate=True)
            self._pending_counts.clear()

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """The tokens just drawn for these (distinct) slots join the tables in use."""
        if self.seen is not None:
            self.seen.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.bool))
        if self.counts is not None:
            self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32),
                                   accumulate=True)
