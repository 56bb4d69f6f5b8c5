"""Two-shot all-reduce fused with the residual add and RMSNorm, for TP prefill chunks.

Why: a prefill chunk's row-parallel outputs (8,192 tokens x 4,096 x bf16 = 64 MiB for Qwen3-8B)
are past the one-shot kernel's sizes (kernels/all_reduce.py), and went through NCCL (~250 us on
two H100s) followed by the add+RMSNorm kernel (another pass over 4 x 64 MiB), twice a layer. Here
one kernel does both, in three phases over the rows (rank r owns the r-th of `world` equal row
ranges):
1. reduce-scatter: each rank stores its partial sums of every other rank's rows into its slot of
   that rank's IPC buffer;
2. each rank sums its own rows (fp32, rank order, as the one-shot kernels: the same bits on every
   rank and as NCCL + the norm kernel on two ranks), adds the residual, normalizes, writes both,
   and stores the new residual rows into its slot of every other rank's buffer (all-gather);
3. each rank writes the other ranks' new residual rows and their norms.
A rank's NVLink traffic is 2 (world - 1) / world of the message each way, as a ring all-reduce.

Synchronisation is per program, as the one-shot's barrier protocol (all_reduce_kernels.meet): the
same program handles the same rows on every rank, and the programs of one rank meet those of the
others after each phase. Between calls the row split moves with the row count, so a row's slot
may be read by one program in a call and written by another in the next: the third meeting,
after the last reads, orders every read of a call before any rank's next call writes (a rank's
next call starts only after all of its programs met their peers there). All programs must be
resident at once: the grid is at most the SM count.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ..distributed.peer_buffers import PeerBuffers, exchange
from .all_reduce_kernels import meet, rank_delta, store_norm_row


@triton.jit
def _slot(sender: tl.constexpr, receiver: tl.constexpr, WORLD: tl.constexpr):
    """A receiver's buffer has one slot per other rank: the sender's is (s - r - 1) mod world."""
    return (sender - receiver - 1 + WORLD) % WORLD


# `rows` (a prefill step's token count) is not specialised: one compile, at start-up (`warm_up`),
# serves every step; Triton would otherwise compile again for the first step whose count falls in
# another class (a multiple of 16 or not), inside a request.
@triton.jit(do_not_specialize=["rows"])
def two_shot_all_reduce_rmsnorm(x_ptr, res_ptr, w_ptr, out_ptr, buf_ptr, d0, d1, d2, d3, d4, d5,
                                d6, d7, flag_ptrs, counter_ptr, rows, D, slot, eps,
                                RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """x [rows, D]: this rank's partial sums (left as they are). residual += the sum over the
    ranks of x; out = RMSNorm(residual) * w. buf_ptr: this rank's buffer, [world - 1 slots][slot
    elements]; rank r's buffer as mapped here is buf_ptr + d_r."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(counter_ptr + pid) + 1
    cols = tl.arange(0, BLOCK)
    m = cols < D
    per = (rows + WORLD - 1) // WORLD
    # 1. my partials of every other rank's rows, into my slot of that rank's buffer
    for r in tl.static_range(WORLD):
        if r != RANK:
            dst = buf_ptr + rank_delta(r, d0, d1, d2, d3, d4, d5, d6, d7) \
                + _slot(RANK, r, WORLD) * slot
            for row in range(r * per + pid, tl.minimum(r * per + per, rows), nprog):
                v = tl.load(x_ptr + row * D + cols, mask=m)
                tl.store(dst + row * D + cols, v, mask=m)
    meet(flag_ptrs, pid, RANK, 3 * epoch - 2, WORLD)
    # 2. my rows: the sum, the add and the norm; the new residual rows to every other rank
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    for row in range(RANK * per + pid, tl.minimum(RANK * per + per, rows), nprog):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                acc += tl.load(x_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
            else:
                # .cg: past L1, whose lines may hold this row from an earlier call
                acc += tl.load(buf_ptr + _slot(r, RANK, WORLD) * slot + row * D + cols, mask=m,
                               other=0.0, cache_modifier=".cg").to(tl.float32)
        h = acc.to(x_ptr.dtype.element_ty) + tl.load(res_ptr + row * D + cols, mask=m, other=0.0)
        for r in tl.static_range(WORLD):
            if r != RANK:
                dst = buf_ptr + rank_delta(r, d0, d1, d2, d3, d4, d5, d6, d7) \
                    + _slot(RANK, r, WORLD) * slot
                tl.store(dst + row * D + cols, h, mask=m)
        store_norm_row(h, row, res_ptr, out_ptr, w, cols, m, D, eps)
    meet(flag_ptrs, pid, RANK, 3 * epoch - 1, WORLD)
    # 3. the other ranks' rows, as they summed them
    for r in tl.static_range(WORLD):
        if r != RANK:
            src = buf_ptr + _slot(r, RANK, WORLD) * slot
            for row in range(r * per + pid, tl.minimum(r * per + per, rows), nprog):
                h = tl.load(src + row * D + cols, mask=m, other=0.0, cache_modifier=".cg")
                store_norm_row(h, row, res_ptr, out_ptr, w, cols, m, D, eps)
    meet(flag_ptrs, pid, RANK, 3 * epoch, WORLD)
    tl.store(counter_ptr + pid, epoch)


class TwoShotAddRMSNorm:
    """`add_rmsnorm` of kernels/all_reduce.py for messages up to `max_bytes`, in place of NCCL
    followed by the norm. Build with `create` (collective: every rank together)."""

    def __init__(self, data: PeerBuffers, flags: PeerBuffers, rank: int, world: int,
                 max_bytes: int, programs: int) -> None:
        self.data, self.flags = data, flags
        self.rank, self.world, self.max_bytes = rank, world, max_bytes
        self.grid = (programs,)  # the same every call: each program counts its own calls
        self.counter = torch.zeros(programs, dtype=torch.int32, device=data.local.device)
        self._deltas: dict[torch.dtype, list[int]] = {}

    @classmethod
    def create(cls, rank: int, world: int, cpu_group: Any, device: torch.device,
               max_bytes: int, programs: int) -> TwoShotAddRMSNorm:
        """programs: at most the SM count (every program resident), the same on every rank
        (OneShotAllReduce.create passes its own)."""
        data = exchange((world - 1) * max_bytes, rank, world, cpu_group, device)
        flags = exchange(programs * world * 4, rank, world, cpu_group, device)
        return cls(data, flags, rank, world, max_bytes, programs)

    def supports(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.max_bytes

    def warm_up(self, dtype: torch.dtype, hidden_size: int) -> None:
        """Compile the kernel for rows of `hidden_size` (collective: every rank together, as
        any call): a few rows stand in for every size."""
        dev = self.data.local.device
        x = torch.zeros(self.world, hidden_size, dtype=dtype, device=dev)
        residual = torch.zeros_like(x)
        self.add_rmsnorm(x, residual, torch.ones(hidden_size, dtype=dtype, device=dev), 1e-6)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
        """x [N, D] and residual contiguous, `supports(x)`: as OneShotAllReduce.add_rmsnorm."""
        rows, d = x.shape
        out = torch.empty_like(x)
        if rows == 0:
            return out
        size = x.element_size()
        deltas = self._deltas.get(x.dtype)
        if deltas is None:
            own = self.data.local.data_ptr()
            deltas = [(p - own) // size for p in self.data.addresses]
            deltas = self._deltas[x.dtype] = deltas + [0] * (8 - len(deltas))
        two_shot_all_reduce_rmsnorm[self.grid](
            x, residual, weight, out, self.data.local.view(x.dtype), *deltas, self.flags.ptrs,
            self.counter, rows, d, self.max_bytes // size, eps, RANK=self.rank, WORLD=self.world,
            BLOCK=triton.next_power_of_2(d), num_warps=4 if d <= 2048 else 8)
        return out
