"""OpenAI `logit_bias`: per-slot sparse additive biases, applied to the fp32 logits before the
penalties. Only batches with a biased row reach `apply`; the sampler's fast paths never see it."""

from __future__ import annotations

import numpy as np
import torch

from .upload import upload


class SlotBiases:
    def __init__(self, max_slots: int, device: torch.device) -> None:
        self.device = device
        self.active = np.zeros(max_slots, dtype=bool)
        self.n_active = 0
        self._bias: list[tuple[list[int], list[float]] | None] = [None] * max_slots

    def set_slot(self, slot: int, bias: dict[int, float]) -> None:
        if self.active[slot]:
            self.n_active -= 1
        entry = (list(bias), list(bias.values())) if bias else None
        self._bias[slot] = entry
        self.active[slot] = entry is not None
        self.n_active += int(entry is not None)

    def apply(self, x: torch.Tensor, host_slots: np.ndarray) -> None:
        """Adds the biases of the batch's rows to `x` [B, V] (fp32) in place."""
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        for row in np.flatnonzero(self.active[host_slots]).tolist():
            entry = self._bias[int(host_slots[row])]
            assert entry is not None
            rows += [row] * len(entry[0])
            cols += entry[0]
            vals += entry[1]
        if not rows:
            return
        index = upload(torch.tensor([rows, cols], dtype=torch.int64), self.device)
        values = upload(torch.tensor(vals, dtype=torch.float32), self.device)
        x.index_put_((index[0], index[1]), values, accumulate=True)
