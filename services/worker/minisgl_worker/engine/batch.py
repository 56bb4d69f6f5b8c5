"""From a StepPlan to a ForwardBatch: validation, page-table updates and the step's metadata.

Everything here runs on the host with numpy over mirrors the worker keeps (the page table, which
slots hold a sampled token), so building a step never waits for the device. All integer metadata
goes to the device in two copies, int64 and int32, from reused pinned buffers on CUDA.

Validation happens before any state changes: a bad plan raises `InvalidPlan` and leaves the
worker exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from minisgl_core.step import StepPlan

from ..attention.base import ForwardBatch, csr_page_layout


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
                 max_model_len: int, vocab_size: int, device: torch.device,
                 dummy_page: int | None = None, window_pages: int = 0) -> None:
        self.max_slots, self.max_pages, self.num_pages = max_slots, max_pages_per_seq, num_pages
        self.dummy_page = num_pages if dummy_page is None else dummy_page  # = KVPool.dummy_page
        self.page_size, self.max_model_len, self.vocab_size = page_size, max_model_len, vocab_size
        self.device = device
        self.page_table = np.zeros((max_slots, max_pages_per_seq), dtype=np.int32)
        self.pages_len = np.zeros(max_slots, dtype=np.int64)  # valid page-table entries
        self.has_future = np.zeros(max_slots, dtype=bool)  # a sampled token waits in the slot
        self._ring = PinnedRing(device) if device.type == "cuda" else None
        # Window pool (KVPool.window_layers): the second page table's mirror; its dummy page
        # (= window_pages) stands for -1, a logical page without window KV.
        self.window_pages = window_pages
        self.window_table = (np.full((max_slots, max_pages_per_seq), window_pages, dtype=np.int32)
                             if window_pages else None)

    # -- validation ---------------------------------------------------------------------------

    def validate(self, plan: StepPlan) -> None:
        """Raise InvalidPlan unless `plan` keeps the worker contract. Checked over numpy columns
        first; only a failing plan walks its entries one by one, for the precise message."""
        if not self._plan_ok(plan):
            self._validate_each(plan)

    def _plan_ok(self, plan: StepPlan) -> bool:
        d, reqs = plan.decodes, plan.reqs
        nd = len(d.rids)
        if not nd and not reqs:
            return True
        if nd and not d.consistent():
            return False
        slots = np.array(d.slots + [r.slot for r in reqs], dtype=np.int64)
        if slots.min() < 0 or slots.max() >= self.max_slots or np.bincount(slots).max() > 1:
            return False
        cache = np.array(d.cache_lens + [r.cache_len for r in reqs], dtype=np.int64)
        offset = np.array(d.page_offsets + [r.page_offset for r in reqs], dtype=np.int64)
        num_new = np.array(d.new_page_counts + [len(r.new_pages) for r in reqs], dtype=np.int64)
        num_in = np.ones(len(slots), dtype=np.int64)
        num_in[nd:] = [len(r.input_ids) for r in reqs]
        end = offset + num_new
        seq = cache + num_in
        pages = np.where(num_new > 0, end, self.pages_len[slots])
        if (cache.min() < 0 or offset.min() < 0 or end.max() > self.max_pages
                or seq.max() > self.max_model_len or (seq > pages * self.page_size).any()
                or not self.has_future[slots[:nd]].all() or not num_in[nd:].all()):
            return False
        if d.new_pages and (min(d.new_pages) < 0 or max(d.new_pages) >= self.num_pages):
            return False
        if not self._window_ok(d.new_pages, d.new_window_pages):
            return False
        vocab = self.vocab_size
        for r in reqs:  # list fields
            if r.new_pages and (min(r.new_pages) < 0 or max(r.new_pages) >= self.num_pages):
                return False
            if not self._window_ok(r.new_pages, r.new_window_pages):
                return False
            if min(r.input_ids) < 0 or max(r.input_ids) >= vocab:
                return False
            if r.history_ids and (min(r.history_ids) < 0 or max(r.history_ids) >= vocab):
                return False
        return True

    def _window_ok(self, pages: list[int], window: list[int]) -> bool:
        """Window pages aligned with `pages` and in [-1, window_pages) with a window pool;
        none without."""
        if not self.window_pages:
            return not window
        return len(window) == len(pages) and (
            not window or (min(window) >= -1 and max(window) < self.window_pages))

    def _validate_each(self, plan: StepPlan) -> None:
        d = plan.decodes
        if not d.consistent():
            raise InvalidPlan(f"step {plan.step_id}: decode columns of different lengths, or "
                              "new_page_counts that do not add up to new_pages")
        if not self._window_ok(d.new_pages, d.new_window_pages):
            raise InvalidPlan(f"step {plan.step_id}: decode new_window_pages " + self._window_rule())
        seen: set[int] = set()
        at = 0
        for i, rid in enumerate(d.rids):
            n = d.new_page_counts[i]
            self._check_entry(plan.step_id, seen, rid, d.slots[i], d.cache_lens[i], 1,
                              d.page_offsets[i], d.new_pages[at:at + n])
            at += n
            if not self.has_future[d.slots[i]]:
                raise InvalidPlan(f"step {plan.step_id}, rid {rid}: decode step without a "
                                  f"sampled token in slot {d.slots[i]}")
        for r in plan.reqs:
            where = f"step {plan.step_id}, rid {r.rid}"
            if not r.input_ids:
                raise InvalidPlan(f"{where}: a prefill chunk without input_ids (decodes go in "
                                  "the step's decode columns)")
            self._check_entry(plan.step_id, seen, r.rid, r.slot, r.cache_len, len(r.input_ids),
                              r.page_offset, r.new_pages)
            if not self._window_ok(r.new_pages, r.new_window_pages):
                raise InvalidPlan(f"{where}: new_window_pages " + self._window_rule())
            if min(r.input_ids) < 0 or max(r.input_ids) >= self.vocab_size:
                raise InvalidPlan(f"{where}: token ids must be in [0, {self.vocab_size})")
            if r.history_ids and (min(r.history_ids) < 0
                                  or max(r.history_ids) >= self.vocab_size):
                raise InvalidPlan(f"{where}: history ids must be in [0, {self.vocab_size})")

    def _window_rule(self) -> str:
        if not self.window_pages:
            return "sent to a worker without a window pool"
        return f"must align with new_pages, ids in [-1, {self.window_pages})"

    def _check_entry(self, step_id: int, seen: set[int], rid: int, slot: int, cache_len: int,
                     num_inputs: int, page_offset: int, new_pages: list[int]) -> None:
        where = f"step {step_id}, rid {rid}"
        if not 0 <= slot < self.max_slots:
            raise InvalidPlan(f"{where}: slot {slot} out of range [0, {self.max_slots})")
        if slot in seen:
            raise InvalidPlan(f"{where}: slot {slot} appears twice in one step")
        seen.add(slot)
        if cache_len < 0 or page_offset < 0:
            raise InvalidPlan(f"{where}: cache_len and page_offset must be >= 0")
        end = page_offset + len(new_pages)
        if end > self.max_pages:
            raise InvalidPlan(f"{where}: page table row overflows ({end} > {self.max_pages})")
        if new_pages and (min(new_pages) < 0 or max(new_pages) >= self.num_pages):
            raise InvalidPlan(f"{where}: page ids must be in [0, {self.num_pages})")
        seq = cache_len + num_inputs
        if seq > self.max_model_len:
            raise InvalidPlan(f"{where}: sequence length {seq} exceeds max_model_len "
                              f"{self.max_model_len}")
        pages = end if new_pages else int(self.pages_len[slot])
        if seq > pages * self.page_size:
            raise InvalidPlan(f"{where}: {seq} tokens need {-(-seq // self.page_size)} "
                              f"pages, the slot has {pages}")

    # -- state + metadata -----------------------------------------------------------------------

    def build(self, plan: StepPlan, graph_size: Callable[[int], int | None] | None = None
              ) -> tuple[DeviceStep, np.ndarray]:
        """Apply the plan to the host mirrors and build the step (two host->device copies, one
        int64 and one int32, from pinned memory). Also returns the step's page-table writes on
        the host, int64 [3, N] (slot, column, page); `DeviceStep.page_writes` holds the same on
        the device.

        `graph_size(B)`, when given, names the CUDA-graph batch size a decode batch of B rows
        runs in (None: no graph): the batch is then built already padded to it, padding rows as
        `attention.base` prescribes, so the graph runner has nothing left to grow on the device.
        The decode columns are read with numpy as they come; per prefill chunk only its list
        fields are touched in Python."""
        d, reqs = plan.decodes, plan.reqs
        nd = len(d.rids)
        writes = [self._decode_page_writes(plan)] if d.new_pages else []
        wt = self.window_table
        if wt is not None and d.new_pages:
            w = writes[0]
            wt[w[0], w[1]] = self._window_ids(d.new_window_pages)
        for r in reqs:
            if r.new_pages:
                end = r.page_offset + len(r.new_pages)
                self.page_table[r.slot, r.page_offset:end] = r.new_pages
                if wt is not None:
                    wt[r.slot, r.page_offset:end] = self._window_ids(r.new_window_pages)
                self.pages_len[r.slot] = end
                writes.append(np.stack([np.full(len(r.new_pages), r.slot),
                                        np.arange(r.page_offset, end), r.new_pages]))
        b = nd + len(reqs)
        ps = self.page_size
        ext = np.ones(b, dtype=np.int64)  # decode rows first: one token each
        cache = np.array(d.cache_lens + [r.cache_len for r in reqs], dtype=np.int64)
        slots = np.array(d.slots + [r.slot for r in reqs], dtype=np.int64)
        sample = np.ones(b, dtype=bool)  # every decode samples
        if reqs:
            ext[nd:] = [len(r.input_ids) for r in reqs]
            sample[nd:] = [r.sample for r in reqs]
        self.has_future[slots] = sample  # what the slot holds after this step
        is_decode = b > 0 and (not reqs or bool((ext[nd:] == 1).all()))
        bs = (graph_size(b) or b) if is_decode and graph_size is not None else b
        pad = bs - b
        if pad:  # padding rows: seq_len 1, cache_len 0, slot 0, all pages the dummy page
            ext = np.concatenate([ext, np.ones(pad, dtype=np.int64)])
            cache = np.concatenate([cache, np.zeros(pad, dtype=np.int64)])
        seq = cache + ext
        t = int(ext.sum())
        indptr = np.zeros(bs + 1, dtype=np.int64)
        np.cumsum(ext, out=indptr[1:])
        real_t = int(indptr[b])
        owner = np.repeat(np.arange(b), ext[:b])
        pos = np.zeros(t, dtype=np.int64)
        pos[:real_t] = cache[owner] + (np.arange(real_t) - indptr[owner])
        out_loc = np.full(t, self.dummy_page * ps, dtype=np.int64)
        out_loc[:real_t] = (self.page_table[slots[owner], pos[:real_t] // ps].astype(np.int64) * ps
                            + pos[:real_t] % ps)
        width = max(1, -(-int(seq.max()) // ps)) if bs else 1
        rows = np.full((bs, width), self.dummy_page, dtype=np.int32)
        rows[:b] = self.page_table[slots, :width]
        # FlashInfer's CSR page layout, here so the backend does not rebuild it per step.
        kv_indptr, kv_indices, kv_last = csr_page_layout(seq, rows, ps)
        win64: list[np.ndarray] = []
        win32: list[np.ndarray] = []
        if wt is not None:  # the window pool's locations and rows, padded like the main ones
            win_loc = np.full(t, self.window_pages * ps, dtype=np.int64)
            win_loc[:real_t] = (wt[slots[owner], pos[:real_t] // ps].astype(np.int64) * ps
                                + pos[:real_t] % ps)
            win_rows = np.full((bs, width), self.window_pages, dtype=np.int32)
            win_rows[:b] = wt[slots, :width]
            win64, win32 = [win_loc], [win_rows.reshape(-1)]

        input_ids = np.zeros(t, dtype=np.int64)
        for r, start in zip(reqs, indptr[nd:b].tolist(), strict=True):
            input_ids[start:start + len(r.input_ids)] = r.input_ids
        decode_idx, decode_slots = indptr[:nd], slots[:nd]  # row i of a decode is token i
        sample_idx, sample_slots, sample_pos = indptr[1:b + 1][sample] - 1, slots[sample], seq[:b][sample]
        rids = d.rids + [r.rid for r in reqs if r.sample]
        if pad:
            slots = np.concatenate([slots, np.zeros(pad, dtype=np.int64)])

        page_writes = (np.concatenate(writes, axis=1).astype(np.int64) if writes
                       else np.zeros((3, 0), dtype=np.int64))
        i64 = [input_ids, pos, out_loc, slots, sample_idx, sample_slots, sample_pos, decode_idx,
               decode_slots, page_writes.reshape(-1)] + win64
        # longest first (stable: ties keep row order); padding rows (seq_len 1) end up last
        order = np.argsort(-seq, kind="stable") if is_decode else np.zeros(0, dtype=np.int64)
        i32 = [cache, ext, seq, indptr, rows.reshape(-1), kv_indptr, kv_indices, kv_last,
               order] + win32
        (ids_d, pos_d, loc_d, slots_d, sidx_d, sslots_d, spos_d, didx_d, dslots_d,
         writes_d, *wloc_d), _ = self._upload(i64, np.int64)
        (cache_d, ext_d, seq_d, indptr_d, rows_d, kvp_d, kvi_d, kvl_d, order_d, *wrows_d), host32 = \
            self._upload(i32, np.int32)
        batch = ForwardBatch(
            batch_size=bs, num_tokens=t, is_decode=is_decode, page_size=ps, positions=pos_d,
            out_loc=loc_d, slots=slots_d, cache_lens=cache_d, extend_lens=ext_d, seq_lens=seq_d,
            qo_indptr=indptr_d, page_table=rows_d.view(bs, width),
            cache_lens_host=cache.tolist(), extend_lens_host=ext.tolist(),
            seq_lens_host=seq.tolist(), page_table_host=torch.from_numpy(rows),
            max_seq_len=int(seq.max()) if bs else 0, max_extend_len=int(ext.max()) if bs else 0,
            sample_indices=sidx_d, qo_indptr_host=host32[3], kv_indptr_host=host32[5],
            kv_indices=kvi_d, kv_last_page_len_host=host32[7],
            decode_order=order_d if is_decode else None,
            window_out_loc=wloc_d[0] if wloc_d else None,
            window_page_table=wrows_d[0].view(bs, width) if wrows_d else None,
        )
        step = DeviceStep(batch, ids_d, didx_d, dslots_d, sslots_d, spos_d,
                          sample_slots.tolist(), rids, len(decode_idx), writes_d.view(3, -1))
        return step, page_writes

    def _window_ids(self, ids: list[int]) -> np.ndarray:
        """Window pages as the table holds them: -1 (none kept) as the window dummy page."""
        a = np.asarray(ids, dtype=np.int32)
        return np.where(a < 0, self.window_pages, a)

    def _decode_page_writes(self, plan: StepPlan) -> np.ndarray:
        """Write the decode entries' new pages into the page-table mirror; their (slot, column,
        page) triples, int64 [3, N], in entry order."""
        d = plan.decodes
        counts = np.array(d.new_page_counts, dtype=np.int64)
        slots = np.array(d.slots, dtype=np.int64)
        offsets = np.array(d.page_offsets, dtype=np.int64)
        pages = np.array(d.new_pages, dtype=np.int64)
        first = np.cumsum(counts) - counts  # where each entry's pages start in `pages`
        row = np.repeat(slots, counts)
        col = np.repeat(offsets - first, counts) + np.arange(len(pages))
        self.page_table[row, col] = pages
        grew = counts > 0
        self.pages_len[slots[grew]] = (offsets + counts)[grew]
        return np.stack([row, col, pages])

    def _upload(self, parts: list[np.ndarray], dtype: type
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Concatenate `parts` as `dtype` into one host tensor and copy it to the device without
        waiting; returns the device and the host pieces, split like `parts`. On CUDA the host
        side is a reused pinned buffer (`PinnedRing`): its pieces are valid during this launch."""
        sizes = [len(p) for p in parts]
        # Every piece starts on a 16-byte boundary: Triton specialises a pointer argument on
        # that alignment, so pieces at offsets that follow the batch's sizes made kernels reading
        # them (prefill attention, KV stores) compile a second variant mid-serving, the first
        # time a batch shifted one (tests/gpu/test_compiles.py).
        align = _ALIGN_BYTES // np.dtype(dtype).itemsize
        starts = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([-(-n // align) * align for n in sizes], out=starts[1:])
        if self._ring is not None:
            host, dev = self._ring.upload(parts, starts, dtype)
        else:
            host = torch.empty(int(starts[-1]), dtype=_TORCH_DTYPE[np.dtype(dtype)])
            _pack(host.numpy(), parts, starts)
            dev = host.to(self.device)
        return _pieces(dev, starts, sizes), _pieces(host, starts, sizes)


class PinnedRing:
    """Reused pinned host buffers for the per-step uploads. Fresh pinned memory per step costs
    an allocator round trip (and, on a cache miss, cudaHostAlloc); a ring of buffers does not.
    A buffer is refilled only after the copy that read it has finished (an event per buffer);
    with at most two steps in flight and two uploads a step, that wait is normally over. Host
    pieces handed out (FlashInfer's indptr, read again by its own plan-time copies) thus stay
    intact until two later steps were built, by which time their step has been collected."""

    def __init__(self, device: torch.device, depth: int = 6) -> None:
        self.device = device
        self._bufs: list[torch.Tensor | None] = [None] * depth
        self._events: list[torch.cuda.Event | None] = [None] * depth
        self._next = 0

    def upload(self, parts: list[np.ndarray], starts: np.ndarray, dtype: type
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`parts` packed at element offsets `starts` (one more than the parts: the end)."""
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        event = self._events[i]
        if event is not None:
            event.synchronize()
        count = int(starts[-1])
        nbytes = count * np.dtype(dtype).itemsize
        buf = self._bufs[i]
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, 2 * (buf.numel() if buf is not None else 1 << 16))
            buf = self._bufs[i] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host = buf[:nbytes].view(_TORCH_DTYPE[np.dtype(dtype)])
        if count:
            _pack(host.numpy(), parts, starts)
        dev = host.to(self.device, non_blocking=True)
        event = self._events[i] = torch.cuda.Event()
        event.record()
        return host, dev


_TORCH_DTYPE = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
_ALIGN_BYTES = 16


def _pack(out: np.ndarray, parts: list[np.ndarray], starts: np.ndarray) -> None:
    for part, start in zip(parts, starts.tolist(), strict=False):
        out[start:start + len(part)] = part  # cast to out's dtype (the ids fit it)


def _pieces(t: torch.Tensor, starts: np.ndarray, sizes: list[int]) -> list[torch.Tensor]:
    return [t.narrow(0, start, n) for start, n in zip(starts.tolist(), sizes, strict=False)]
