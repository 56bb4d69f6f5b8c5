"""One-shot all-reduce over CUDA IPC peer buffers, for the small messages of TP decode.

Why: a TP decode step all-reduces twice per layer (after attention's and the MLP's row-parallel
projections), a few KB at batch 1 and a few MB at batch 256. NCCL's latency for such messages
(~10-20 us with NVLink multicast off, as it must stay on these machines) is paid 2 x layers times a
step. Here one kernel does it: every rank stores its input into its slot of the other ranks'
IPC-mapped buffers (remote stores are posted, many in flight at once), learns that the peers'
inputs have arrived, then sums the slots (fp32, rank order: every rank gets bit-identical sums,
which TP sampling needs). Two ways to learn it, chosen at `create`:
- "lamport" (default): the data is its own flag; see all_reduce_kernels.py, above its kernels.
- "barrier": each rank also stores into its own slot, then meets the same program of every other
  rank at a flag barrier, as described next.
Message sizes past `max_bytes` and shapes it does not take go to NCCL (`supports`), except that
`add_rmsnorm` takes larger ones (prefill chunks) up to `large_bytes` through the two-shot kernel
of kernels/two_shot.py.

Epochs: each program counts its launches in device memory (so CUDA graph replays count), and a
buffer has two halves used alternately by epoch parity. Every call runs the same grid
(`MAX_PROGRAMS`, or the SM count if smaller; the Lamport kernels twice that), however small the
message (idle programs only count), so every program's epoch is the call's number and
consecutive calls use different halves whichever program handles which element (with a grid
sized to the message, a program idle in one call fell behind and could pick the half the
previous call still read on a lagging peer). The Lamport kernels run two programs an SM where
two are sure to fit (`_lamport_workers`): more stores and polls in flight, 2 MiB in 10.0
instead of 11.2 us on 2x H100; the other programs of their grid only count the call.
Programs handle the same elements on every rank: every rank runs the same collectives on the
same shapes.
Barrier synchronisation, per program: after the copy, `bar.sync` then a system-scope release
store of `epoch` into each peer's flag slot [program, my rank]; then acquire-spin on this rank's
slots [program, peer] until >= epoch. Two halves are enough: a rank writes the half of epoch e+2
only after passing barrier e+1, which its peers enter only after they finished reading epoch e.
All programs must be resident at once (a spinning program waits for another GPU, never for a
program of its own grid that is not scheduled): the grid is at most the SM count. The Lamport
kernels are launched with programmatic dependent launch (kernels/pdl.py) where it is on.
No NVLink multicast, no NVSHMEM: plain peer loads and stores.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import triton

from ..distributed.peer_buffers import PeerBuffers, exchange, peer_access_ok
from .all_reduce_kernels import (
    barrier_all_reduce,
    barrier_all_reduce_rmsnorm,
    lamport_all_reduce,
    lamport_all_reduce_rmsnorm,
)
from .pdl import options as _pdl_options
from .two_shot import TwoShotAddRMSNorm

log = logging.getLogger(__name__)

MAX_PROGRAMS = 128  # capped at the SM count (`create`): every program resident
BLOCK = 1024  # elements a program moves per iteration (8 per thread at 4 warps: 16 B for bf16)
# Larger messages go to NCCL. On 2 H200s (bench/micro/all_reduce.py, per op inside a CUDA graph)
# the push beats NCCL up to 8 MiB; a pull variant (each rank loading the others' buffers over
# NVLink) was slower and dropped (docs/benchmarks/log/2026-11-26-tp.md).
DEFAULT_MAX_BYTES = 8 << 20
# One-shot reads world x the message on each rank: past 2 ranks keep it to small messages.
MAX_BYTES_PAST_TWO = 512 << 10
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _lamport_workers(programs: int, warps: int, block: int) -> tuple[int, dict[str, int]]:
    """The programs of a Lamport kernel that move data, and its launch options. Every working
    program must be resident at once (each waits for its peers' twins): two an SM only where
    two surely fit, i.e. with their registers capped at half the SM's 64K (4 warps: any count
    fits; 8 warps: 128 a thread, what the 4,096-wide norm row needs anyway); `programs` (one an
    SM) otherwise."""
    if warps == 4:
        return 2 * programs, {}
    if warps == 8 and block <= 4096:
        return 2 * programs, {"maxnreg": 128}
    return programs, {}


def _pdl_one_row(x: torch.Tensor) -> dict[str, bool]:
    """PDL for one-row steps, whose next kernel is the one-row GEMV: it streams its weights while
    this one waits for the peers. More rows are followed by cuBLAS, launched without PDL."""
    return _pdl_options(x) if x.dim() == 2 and x.shape[0] == 1 else {"USE_PDL": False}


class OneShotAllReduce:
    """In-place sum of a tensor over the TP ranks. Build with `create` (collective)."""

    def __init__(self, data: PeerBuffers, flags: PeerBuffers | None, rank: int, world: int,
                 max_bytes: int, programs: int = MAX_PROGRAMS,
                 large: TwoShotAddRMSNorm | None = None) -> None:
        self.data, self.flags = data, flags  # no flags: the Lamport protocol
        self.large = large  # add_rmsnorm past max_bytes
        self.rank, self.world = rank, world
        self.max_bytes = max_bytes
        self.programs = programs  # one an SM at most
        # every call, every rank: see the module's note on epochs
        self.grid = (2 * programs,) if flags is None else (programs,)
        self.counter = torch.zeros(2 * MAX_PROGRAMS, dtype=torch.int32, device=data.local.device)
        self._by_dtype: dict[torch.dtype, tuple[torch.Tensor, list[int]]] = {}

    @classmethod
    def create(cls, rank: int, world: int, cpu_group: Any, device: torch.device,
               max_bytes: int = DEFAULT_MAX_BYTES, protocol: str | None = None,
               large_bytes: int = 0) -> OneShotAllReduce | None:
        """Every rank calls this together; None (every rank alike) where peer access is missing.
        protocol: "lamport" (the default) or "barrier"; MINISGL_ALL_REDUCE_PROTOCOL sets it.
        large_bytes: the largest message of `add_rmsnorm`'s two-shot path (0: none; it holds
        (world - 1) x this in an IPC buffer)."""
        protocol = protocol or os.environ.get("MINISGL_ALL_REDUCE_PROTOCOL") or "lamport"
        if protocol not in ("lamport", "barrier"):
            raise ValueError(f"all-reduce protocol {protocol!r}: lamport or barrier")
        # Peer access, and the SM count (the grid, the same on every rank, must fit at once).
        ok = torch.tensor([1 if device.type == "cuda" and peer_access_ok(world) else 0,
                           torch.cuda.get_device_properties(device).multi_processor_count
                           if device.type == "cuda" else 0])
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN, group=cpu_group)
        programs = min(MAX_PROGRAMS, int(ok[1]))
        if not int(ok[0]):
            log.info("custom all-reduce off: the GPUs lack peer access; NCCL does every reduce")
            return None
        if world > 8:
            log.info("custom all-reduce off: it takes up to 8 GPUs; NCCL does every reduce")
            return None
        if world > 2:
            max_bytes = min(max_bytes, MAX_BYTES_PAST_TWO)
        large = (TwoShotAddRMSNorm.create(rank, world, cpu_group, device, large_bytes, programs)
                 if large_bytes > max_bytes else None)
        if protocol == "lamport":
            data = exchange(2 * world * max_bytes, rank, world, cpu_group, device, fill=0xFF)
            return cls(data, None, rank, world, max_bytes, programs, large)
        data = exchange(2 * world * max_bytes, rank, world, cpu_group, device)
        flags = exchange(MAX_PROGRAMS * world * 4, rank, world, cpu_group, device)
        return cls(data, flags, rank, world, max_bytes, programs, large)

    def supports(self, x: torch.Tensor, with_norm: bool = False) -> bool:
        """Whether `self(x)` (with_norm: `add_rmsnorm(x, ...)`) takes x."""
        if not (x.is_cuda and x.dtype in _DTYPES and x.is_contiguous()):
            return False
        nbytes = x.numel() * x.element_size()
        return nbytes <= self.max_bytes or (with_norm and self.large is not None
                                            and self.large.supports(x))

    def warm_up(self, dtype: torch.dtype, hidden_size: int) -> None:
        """Compile, at start-up, what only prefill steps past `max_bytes` would reach (the
        two-shot kernel); collective. The one-shot kernels compile in the decode graphs' capture
        and the warm-up prefills."""
        if self.large is not None:
            self.large.warm_up(dtype, hidden_size)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        if n == 0:
            return x
        buf, deltas = self._views(x.dtype)
        slot = self.max_bytes // x.element_size()  # elements
        grid = self.grid
        if self.flags is None:
            workers, opts = _lamport_workers(self.programs, 4, BLOCK)
            lamport_all_reduce[grid](x, buf, *deltas, self.counter, n, slot, workers,
                                      RANK=self.rank, WORLD=self.world, BLOCK=BLOCK,
                                      BITS=x.element_size() * 8, num_warps=4, **opts,
                                      **_pdl_one_row(x))
            return x
        barrier_all_reduce[grid](x, buf, *deltas, self.flags.ptrs, self.counter, n, slot,
                                   self.rank, WORLD=self.world, BLOCK=BLOCK, num_warps=4)
        return x

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
        """The sum of x over the ranks added into `residual` (in place), and RMSNorm of the new
        residual, in one kernel: x [N, D] and residual contiguous, `supports(x, with_norm=True)`
        (past max_bytes: the two-shot kernel)."""
        if x.numel() * x.element_size() > self.max_bytes:
            assert self.large is not None, "add_rmsnorm past max_bytes without a two-shot path"
            return self.large.add_rmsnorm(x, residual, weight, eps)
        rows, d = x.shape
        out = torch.empty_like(x)
        if rows == 0:
            return out
        buf, deltas = self._views(x.dtype)
        block = triton.next_power_of_2(d)
        warps = 4 if d <= 2048 else 8  # as the norm kernel: the same reduction order
        slot = self.max_bytes // x.element_size()
        grid = self.grid
        if self.flags is None:
            workers, opts = _lamport_workers(self.programs, warps, block)
            lamport_all_reduce_rmsnorm[grid](
                x, residual, weight, out, buf, *deltas, self.counter, rows, d, slot, eps,
                workers, RANK=self.rank, WORLD=self.world, BLOCK=block,
                BITS=x.element_size() * 8, num_warps=warps, **opts, **_pdl_one_row(x))
            return out
        barrier_all_reduce_rmsnorm[grid](
            x, residual, weight, out, buf, *deltas, self.flags.ptrs, self.counter, rows, d,
            slot, self.rank, eps, WORLD=self.world, BLOCK=block, num_warps=warps)
        return out

    def _views(self, dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
        """This rank's buffer as `dtype`, and every rank's buffer as an element offset from it."""
        got = self._by_dtype.get(dtype)
        if got is None:
            size = torch.empty((), dtype=dtype).element_size()
            own = self.data.local.data_ptr()
            deltas = [(p - own) // size for p in self.data.addresses]
            deltas += [0] * (8 - len(deltas))
            got = self._by_dtype[dtype] = (self.data.local.view(dtype), deltas)
        return got
