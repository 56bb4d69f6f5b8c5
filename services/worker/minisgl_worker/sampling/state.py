"""The per-slot state the draw reads: parameters, stop ids (masked until min_tokens) and the
number of tokens drawn, on the host and on the device.

`set` writes a slot's row on the host and marks it dirty; `flush` uploads every dirty row at once
(one copy per table a step, rather than a dozen tiny ones per request). The device tensors keep
their addresses, except the stop-id table, which widens when a request brings more stop ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .params import ParamRow, SlotParams
from .upload import upload


class SlotState:
    def __init__(self, max_slots: int, device: torch.device) -> None:
        self.max_slots, self.device = max_slots, device
        self.host = SlotParams.neutral(max_slots)
        # numpy views of the same memory: the per-step plan reads them without torch's per-op
        # overhead (a dozen small CPU tensor ops cost more than the draw's launch).
        self.host_np: SlotParams[np.ndarray] = SlotParams(self.host.floats.numpy(),
                                                          self.host.ints.numpy())
        # (On a CPU device `.to` returns the host tensors themselves: there the device tables
        # are the host ones, and an upload rewrites rows with their own values.)
        self.device_params = SlotParams(self.host.floats.to(device), self.host.ints.to(device))
        self.host_stop = torch.full((max_slots, 1), -1, dtype=torch.int64)  # -1: padding
        self.device_stop = self.host_stop.to(device)
        self.host_out_len = torch.zeros(max_slots, dtype=torch.int64)  # tokens drawn
        self.host_out_len_np = self.host_out_len.numpy()
        self.device_out_len = torch.zeros(max_slots, dtype=torch.int64, device=device)
        self.dirty: set[int] = set()

    def set(self, slot: int, row: ParamRow, stop_ids: Sequence[int]) -> None:
        """A request (re)starts in `slot`: its row, uploaded by the next `flush`."""
        self.host.floats[slot] = row.floats()
        self.host.ints[slot] = row.ints()
        if len(stop_ids) > self.host_stop.shape[1]:
            grown = torch.full((self.max_slots, len(stop_ids)), -1, dtype=torch.int64)
            grown[:, : self.host_stop.shape[1]] = self.host_stop
            self.host_stop = grown
        self.host_stop[slot] = -1
        self.host_stop[slot, : len(stop_ids)] = torch.tensor(stop_ids, dtype=torch.int64)
        self.host_out_len[slot] = 0
        self.dirty.add(slot)

    def flush(self) -> torch.Tensor | None:
        """Upload the dirty rows; returns their slots on the device (None: nothing was dirty),
        whose other per-slot state the caller resets."""
        if not self.dirty:
            return None
        idx_h = torch.tensor(sorted(self.dirty), dtype=torch.int64)
        idx = upload(idx_h, self.device)
        self.device_params.floats[idx] = upload(self.host.floats[idx_h], self.device)
        self.device_params.ints[idx] = upload(self.host.ints[idx_h], self.device)
        if self.device_stop.shape[1] != self.host_stop.shape[1]:
            self.device_stop = upload(self.host_stop, self.device)
        else:
            self.device_stop[idx] = upload(self.host_stop[idx_h], self.device)
        # index_fill_, not `t[idx] = 0`: that uploads the scalar with a blocking copy, which
        # made the host wait for the GPU on every step that admitted a request.
        self.device_out_len.index_fill_(0, idx, 0)
        self.dirty.clear()
        return idx

    def record(self, slots: torch.Tensor, host_slots: np.ndarray) -> None:
        """One more token drawn for each of these (distinct) slots."""
        self.host_out_len_np[host_slots] += 1
        self.device_out_len.index_add_(0, slots, torch.ones_like(slots))
