"""From a StepPlan to a ForwardBatch: validation, page-table updates and the step's metadata.

Everything here runs on the host with numpy over mirrors the worker keeps (the page table, which
slots hold a sampled token), so building a step never waits for the device. All integer metadata
goes to the device in one copy (pinned memory on CUDA).

Validation happens before any state changes: a bad plan raises `InvalidPlan` and leaves the
worker exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from minisgl_core.step import StepPlan

from .attention.base import ForwardBatch


class InvalidPlan(ValueError):
    """The scheduler sent a plan that violates the worker contract."""


@dataclass
class DeviceStep:
    """One launched step's tensors beyond the ForwardBatch."""

    batch: ForwardBatch
    input_ids: torch.Tensor  # int64 [T]; decode rows are filled from the token futures
    decode_index: torch.Tensor  # int64 [D]: rows of input_ids that decode
    decode_slots: torch.Tensor  # int64 [D]: their slots
    sample_slots: torch.Tensor  # int64 [S]
    sample_positions: torch.Tensor  # int64 [S]: sequence index of each sampled token
    sample_slots_host: list[int]
    sample_rids: list[int]
    decode_count: int
    page_writes: torch.Tensor  # int64 [3, N]: (slot, column, page) entries new this step


class PlanBuilder:
    def __init__(self, max_slots: int, max_pages_per_seq: int, num_pages: int, page_size: int,
                 max_model_len: int, vocab_size: int, device: torch.device) -> None:
        self.max_slots, self.max_pages, self.num_pages = max_slots, max_pages_per_seq, num_pages
        self.page_size, self.max_model_len, self.vocab_size = page_size, max_model_len, vocab_size
        self.device = device
        self.page_table = np.zeros((max_slots, max_pages_per_seq), dtype=np.int32)
        self.pages_len = np.zeros(max_slots, dtype=np.int64)  # valid page-table entries
        self.has_future = np.zeros(max_slots, dtype=bool)  # a sampled token waits in the slot

    # -- validation ---------------------------------------------------------------------------

    def validate(self, plan: StepPlan) -> None:
        seen: set[int] = set()
        for r in plan.reqs:
            where = f"step {plan.step_id}, rid {r.rid}"
            if not 0 <= r.slot < self.max_slots:
                raise InvalidPlan(f"{where}: slot {r.slot} out of range [0, {self.max_slots})")
            if r.slot in seen:
                raise InvalidPlan(f"{where}: slot {r.slot} appears twice in one step")
            seen.add(r.slot)
            if r.cache_len < 0 or r.page_offset < 0:
                raise InvalidPlan(f"{where}: cache_len and page_offset must be >= 0")
            end = r.page_offset + len(r.new_pages)
            if end > self.max_pages:
                raise InvalidPlan(f"{where}: page table row overflows ({end} > {self.max_pages})")
            if r.new_pages and (min(r.new_pages) < 0 or max(r.new_pages) >= self.num_pages):
                raise InvalidPlan(f"{where}: page ids must be in [0, {self.num_pages})")
            if r.input_ids and (min(r.input_ids) < 0 or max(r.input_ids) >= self.vocab_size):
                raise InvalidPlan(f"{where}: token ids must be in [0, {self.vocab_size})")
            if r.history_ids and (min(r.history_ids) < 0
                                  or max(r.history_ids) >= self.vocab_size):
                raise InvalidPlan(f"{where}: history ids must be in [0, {self.vocab_size})")
            if r.is_decode and (r.sampling is not None or not self.has_future[r.slot]):
                raise InvalidPlan(f"{where}: decode step without a sampled token in slot {r.slot}")
            seq = r.cache_len + r.num_input_tokens
            if seq > self.max_model_len:
                raise InvalidPlan(f"{where}: sequence length {seq} exceeds max_model_len "
                                  f"{self.max_model_len}")
            pages = end if r.new_pages else int(self.pages_len[r.slot])
            if seq > pages * self.page_size:
                raise InvalidPlan(f"{where}: {seq} tokens need {-(-seq // self.page_size)} "
                                  f"pages, the slot has {pages}")

    # -- state + metadata -----------------------------------------------------------------------

    def build(self, plan: StepPlan) -> tuple[DeviceStep, np.ndarray]:
        """Apply the plan to the host mirrors and build the step (one host->device copy).
        Also returns the step's page-table writes on the host, int64 [3, N] (slot, column,
        page); `DeviceStep.page_writes` holds the same on the device."""
        reqs = plan.reqs
        writes = []
        for r in reqs:
            if r.new_pages:
                end = r.page_offset + len(r.new_pages)
                self.page_table[r.slot, r.page_offset:end] = r.new_pages
                self.pages_len[r.slot] = end
                writes.append(np.stack([np.full(len(r.new_pages), r.slot),
                                        np.arange(r.page_offset, end), r.new_pages]))
            if r.sampling is not None:
                self.has_future[r.slot] = False
        b = len(reqs)
        ps = self.page_size
        ext = np.array([r.num_input_tokens for r in reqs], dtype=np.int64)
        cache = np.array([r.cache_len for r in reqs], dtype=np.int64)
        slots = np.array([r.slot for r in reqs], dtype=np.int64)
        seq = cache + ext
        t = int(ext.sum())
        indptr = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(ext, out=indptr[1:])
        owner = np.repeat(np.arange(b), ext)
        pos = cache[owner] + (np.arange(t) - indptr[:-1][owner])
        out_loc = self.page_table[slots[owner], pos // ps].astype(np.int64) * ps + pos % ps
        width = max(1, -(-int(seq.max()) // ps)) if b else 1
        rows = self.page_table[slots, :width].astype(np.int64)

        input_ids = np.zeros(t, dtype=np.int64)
        decode_idx, decode_slots, sample_idx, sample_slots, sample_pos, rids = [], [], [], [], [], []
        for i, r in enumerate(reqs):
            start = int(indptr[i])
            if r.is_decode:
                decode_idx.append(start)
                decode_slots.append(r.slot)
            else:
                input_ids[start:start + len(r.input_ids)] = r.input_ids
            if r.sample:
                sample_idx.append(int(indptr[i + 1]) - 1)
                sample_slots.append(r.slot)
                sample_pos.append(int(seq[i]))
                rids.append(r.rid)
                self.has_future[r.slot] = True
            else:
                self.has_future[r.slot] = False

        parts = [input_ids, pos, out_loc, slots, cache, ext, seq, indptr,
                 np.array(sample_idx, dtype=np.int64), np.array(sample_slots, dtype=np.int64),
                 np.array(sample_pos, dtype=np.int64), np.array(decode_idx, dtype=np.int64),
                 np.array(decode_slots, dtype=np.int64), rows.reshape(-1)]
        page_writes = (np.concatenate(writes, axis=1).astype(np.int64) if writes
                       else np.zeros((3, 0), dtype=np.int64))
        parts.append(page_writes.reshape(-1))
        sizes = [len(p) for p in parts]
        host = torch.from_numpy(np.concatenate(parts))
        if self.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        (ids_d, pos_d, loc_d, slots_d, cache_d, ext_d, seq_d, indptr_d, sidx_d, sslots_d, spos_d,
         didx_d, dslots_d, rows_d, writes_d) = dev.split(sizes)
        batch = ForwardBatch(
            batch_size=b, num_tokens=t, is_decode=b > 0 and bool((ext == 1).all()),
            page_size=ps, positions=pos_d, out_loc=loc_d, slots=slots_d,
            cache_lens=cache_d.int(), extend_lens=ext_d.int(), seq_lens=seq_d.int(),
            qo_indptr=indptr_d.int(), page_table=rows_d.view(b, width).int(),
            cache_lens_host=cache.tolist(), extend_lens_host=ext.tolist(),
            seq_lens_host=seq.tolist(), page_table_host=torch.from_numpy(rows.astype(np.int32)),
            max_seq_len=int(seq.max()) if b else 0, max_extend_len=int(ext.max()) if b else 0,
            sample_indices=sidx_d,
        )
        step = DeviceStep(batch, ids_d, didx_d, dslots_d, sslots_d, spos_d, sample_slots, rids,
                          len(decode_idx), writes_d.view(3, -1))
        return step, page_writes
