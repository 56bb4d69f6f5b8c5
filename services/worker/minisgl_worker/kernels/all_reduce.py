"""One-shot all-reduce over CUDA IPC peer buffers, for the small messages of TP decode.

Why: a TP decode step all-reduces twice per layer (after attention's and the MLP's row-parallel
projections), a few KB at batch 1 and a few MB at batch 256. NCCL's latency for such messages
(~10-20 us with NVLink multicast off, as it must stay on these machines) is paid 2 x layers times a
step. Here one kernel does it: every rank stores its input into its slot of the other ranks'
IPC-mapped buffers (remote stores are posted, many in flight at once), learns that the peers'
inputs have arrived, then sums the slots (fp32, rank order: every rank gets bit-identical sums,
which TP sampling needs). Two ways to learn it, chosen at `create`:
- "lamport" (default): the data is its own flag; see the section above `_lamport_all_reduce`.
- "barrier": each rank also stores into its own slot, then meets the same program of every other
  rank at a flag barrier, as described next.
Message sizes past `max_bytes` and shapes it does not take go to NCCL (`supports`).

Epochs: each program counts its launches in device memory (so CUDA graph replays count), and a
buffer has two halves used alternately by epoch parity. Every call runs the same grid
(`MAX_PROGRAMS`, or the SM count if smaller), however small the message (idle programs only
count), so every program's epoch is the call's number and consecutive calls use different halves
whichever program handles which element (with a grid sized to the message, a program idle in one
call fell behind and could pick the half the previous call still read on a lagging peer).
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
import triton.language as tl

from ..distributed.peer_buffers import PeerBuffers, exchange, peer_access_ok
from .pdl import begin as _pdl_begin
from .pdl import options as _pdl_options

log = logging.getLogger(__name__)

# A rank that waits this long for a peer at the barrier (the peer died, or its process hangs)
# traps: a CUDA error in this process, so its step fails and the engine is seen to be lost,
# instead of a kernel that never ends. As long as the TP group's own collective timeout (a peer
# may legitimately lag by a first-use kernel compile).
TIMEOUT_NS: tl.constexpr = tl.constexpr(300 * 10**9)
MAX_PROGRAMS = 128  # capped at the SM count (`create`): every program resident
BLOCK = 1024  # elements a program moves per iteration (8 per thread at 4 warps: 16 B for bf16)
# Larger messages go to NCCL. On 2 H200s (bench/micro/all_reduce.py, per op inside a CUDA graph)
# push took 4.0 / 6.2 / 12.2 / 36.9 us at 8 KiB / 512 KiB / 2 MiB / 8 MiB against NCCL's 15.7 /
# 19.0 / 37.9 / 56.5. (A pull variant, each rank loading the others' buffers over NVLink, took
# 4.4 / 7.5 / 14.8 / 43.6 and was dropped: docs/benchmarks/log/2026-11-26-tp.md.)
DEFAULT_MAX_BYTES = 8 << 20
# One-shot reads world x the message on each rank: past 2 ranks keep it to small messages.
MAX_BYTES_PAST_TWO = 512 << 10
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _rank_delta(r: tl.constexpr, d0, d1, d2, d3, d4, d5, d6, d7):
    # Scalar arguments, not a pointer table: Triton then knows every buffer is 16-byte aligned
    # (it specialises integer arguments divisible by 16) and vectorises the peer loads.
    if r == 0:
        d = d0
    elif r == 1:
        d = d1
    elif r == 2:
        d = d2
    elif r == 3:
        d = d3
    elif r == 4:
        d = d4
    elif r == 5:
        d = d5
    elif r == 6:
        d = d6
    else:
        d = d7
    return d


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _trap():
    tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _barrier(flag_ptrs, counter_ptr, pid, rank, epoch, WORLD: tl.constexpr):
    """Meet program `pid` of every other rank at `epoch`, then record the epoch."""
    # Every thread's stores are done before the flags say so (release is cumulative over
    # bar.sync); after the acquire, every thread's loads see the peers' stores.
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        if r != rank:
            peer_flags = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + pid * WORLD + rank, epoch, sem="release", scope="sys")
    my_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        if r != rank:
            seen = tl.atomic_add(my_flags + pid * WORLD + r, 0, sem="acquire", scope="sys")
            if seen < epoch:
                start = _now_ns()
                while seen < epoch:
                    if _now_ns() - start > TIMEOUT_NS:
                        _trap()  # the peer never came: fail the context, do not hang
                    seen = tl.atomic_add(my_flags + pid * WORLD + r, 0, sem="acquire",
                                         scope="sys")
    tl.debug_barrier()
    tl.store(counter_ptr + pid, epoch)


@triton.jit
def _one_shot_all_reduce(x_ptr, buf_ptr, d0, d1, d2, d3, d4, d5, d6, d7, flag_ptrs,
                         counter_ptr, n, slot, rank, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    # buf_ptr: this rank's buffer (x's dtype); rank r's buffer, as mapped here: buf_ptr + d_r.
    # A buffer is [2 epoch parities][WORLD slots][slot elements]. Each rank stores its input
    # into slot `rank` of every rank's buffer (remote stores are posted, so many are in flight
    # at once), then sums its own buffer's slots with local loads.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(counter_ptr + pid) + 1
    base = (epoch % 2) * WORLD * slot
    cols = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = tl.multiple_of(start, BLOCK) + cols
        m = offs < n
        v = tl.load(x_ptr + offs, mask=m)
        for r in tl.static_range(WORLD):
            dst = buf_ptr + _rank_delta(r, d0, d1, d2, d3, d4, d5, d6, d7) + base
            tl.store(dst + rank * slot + offs, v, mask=m)
    _barrier(flag_ptrs, counter_ptr, pid, rank, epoch, WORLD)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = tl.multiple_of(start, BLOCK) + cols
        m = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            src = buf_ptr + base + r * slot
            # .cg: past L1, whose lines may hold this half from two epochs ago.
            acc += tl.load(src + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(x_ptr + offs, acc.to(x_ptr.dtype.element_ty), mask=m)


@triton.jit
def _one_shot_all_reduce_rmsnorm(x_ptr, res_ptr, w_ptr, out_ptr, buf_ptr, d0, d1, d2, d3, d4, d5,
                                 d6, d7, flag_ptrs, counter_ptr, rows, D, slot, rank, eps,
                                 WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """x [rows, D]: this rank's partial sums (left as they are). residual += sum over ranks of x;
    out = RMSNorm(residual) * w, in the activation dtype, with the arithmetic of
    fused_kernels._rmsnorm_kernel after a plain all-reduce (the same bits)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(counter_ptr + pid) + 1
    base = (epoch % 2) * WORLD * slot
    cols = tl.arange(0, BLOCK)
    m = cols < D
    for row in range(pid, rows, nprog):
        v = tl.load(x_ptr + row * D + cols, mask=m)
        for r in tl.static_range(WORLD):
            dst = buf_ptr + _rank_delta(r, d0, d1, d2, d3, d4, d5, d6, d7) + base
            tl.store(dst + rank * slot + row * D + cols, v, mask=m)
    _barrier(flag_ptrs, counter_ptr, pid, rank, epoch, WORLD)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    for row in range(pid, rows, nprog):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            acc += tl.load(buf_ptr + base + r * slot + row * D + cols, mask=m, other=0.0,
                           cache_modifier=".cg").to(tl.float32)
        h = acc.to(x_ptr.dtype.element_ty) + tl.load(res_ptr + row * D + cols, mask=m, other=0.0)
        tl.store(res_ptr + row * D + cols, h, mask=m)
        hf = h.to(tl.float32)
        inv = tl.rsqrt(tl.sum(hf * hf, axis=0) / D + eps)
        tl.store(out_ptr + row * D + cols, (hf * inv * w).to(x_ptr.dtype.element_ty), mask=m)


# --- Lamport protocol: the data is its own flag -------------------------------------------------
# Buffers hold EMPTY (all bits set: a NaN in bf16/fp16/fp32) wherever no message is in flight. A
# rank stores its (sanitized: a NaN with all bits set becomes the canonical NaN) input straight
# into its slot of every *other* rank's buffer, then polls its own buffer's slots with volatile
# loads until no element of them is EMPTY, sums them with its own input in rank order, and writes
# EMPTY back over what it read. No fence and no flag round trip: one NVLink flight a call.
# Two halves (epoch parity) suffice: a peer writes this rank's half of epoch e+2 only after it has
# read this rank's epoch e+1 message, which this rank sends after its epoch-e kernel (and the
# clearing in it) has completed; the half of epoch e+1 was cleared by the kernel of epoch e-1.


@triton.jit
def _lamport_empty(BLOCK: tl.constexpr, BITS: tl.constexpr):
    return tl.full([BLOCK], -1, tl.int16 if BITS == 16 else tl.int32)


@triton.jit
def _lamport_pending(v, m, BITS: tl.constexpr):
    bits = v.to(tl.int16 if BITS == 16 else tl.int32, bitcast=True)
    return tl.sum(((bits == -1) & m).to(tl.int32), axis=0)


@triton.jit
def _lamport_sanitize(v, BITS: tl.constexpr):
    """EMPTY (a NaN) in an input becomes the NaN with the sign bit clear: still a NaN."""
    bits = v.to(tl.int16 if BITS == 16 else tl.int32, bitcast=True)
    top = 0x7FFF if BITS == 16 else 0x7FFFFFFF
    fixed = tl.where(bits == -1, bits & top, bits).to(bits.dtype)
    return fixed.to(v.dtype, bitcast=True)


@triton.jit
def _lamport_take(src, m, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """Wait until every element of src[m] holds a peer's value, return them, leave EMPTY."""
    v = tl.load(src, mask=m, other=0.0, volatile=True)
    if _lamport_pending(v, m, BITS) > 0:
        start = _now_ns()
        while _lamport_pending(v, m, BITS) > 0:
            if _now_ns() - start > TIMEOUT_NS:
                _trap()  # the peer never came: fail the context, do not hang
            v = tl.load(src, mask=m, other=0.0, volatile=True)
    tl.store(src, _lamport_empty(BLOCK, BITS).to(v.dtype, bitcast=True), mask=m)
    return v


@triton.jit
def _lamport_push(v, buf_ptr, d0, d1, d2, d3, d4, d5, d6, d7, offs, m, base, slot,
                  RANK: tl.constexpr, WORLD: tl.constexpr):
    """Store this rank's (sanitized) elements at `offs` into its slot of every other rank."""
    for r in tl.static_range(WORLD):
        if r != RANK:
            dst = buf_ptr + _rank_delta(r, d0, d1, d2, d3, d4, d5, d6, d7) + base
            tl.store(dst + RANK * slot + offs, v, mask=m)


@triton.jit
def _lamport_sum(x_ptr, buf_ptr, offs, m, base, slot, RANK: tl.constexpr, WORLD: tl.constexpr,
                 BLOCK: tl.constexpr, BITS: tl.constexpr):
    """fp32 sum over the ranks of the elements at `offs`, in rank order (every rank gets the
    same bits): this rank's own input, the others' as they arrive in this rank's buffer."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            own = tl.load(x_ptr + offs, mask=m, other=0.0)
            acc += _lamport_sanitize(own, BITS).to(tl.float32)
        else:
            acc += _lamport_take(buf_ptr + base + r * slot + offs, m, BLOCK, BITS).to(tl.float32)
    return acc


@triton.jit
def _lamport_all_reduce(x_ptr, buf_ptr, d0, d1, d2, d3, d4, d5, d6, d7, counter_ptr, n, slot,
                        RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                        BITS: tl.constexpr, USE_PDL: tl.constexpr = False):
    # PDL: every program is resident when it releases the next kernel, so none waits on that one.
    _pdl_begin(USE_PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(counter_ptr + pid) + 1
    base = (epoch % 2) * WORLD * slot
    cols = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = tl.multiple_of(start, BLOCK) + cols
        m = offs < n
        v = _lamport_sanitize(tl.load(x_ptr + offs, mask=m), BITS)
        _lamport_push(v, buf_ptr, d0, d1, d2, d3, d4, d5, d6, d7, offs, m, base, slot, RANK, WORLD)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = tl.multiple_of(start, BLOCK) + cols
        m = offs < n
        acc = _lamport_sum(x_ptr, buf_ptr, offs, m, base, slot, RANK, WORLD, BLOCK, BITS)
        tl.store(x_ptr + offs, acc.to(x_ptr.dtype.element_ty), mask=m)
    tl.store(counter_ptr + pid, epoch)


@triton.jit
def _lamport_all_reduce_rmsnorm(x_ptr, res_ptr, w_ptr, out_ptr, buf_ptr, d0, d1, d2, d3, d4, d5,
                                d6, d7, counter_ptr, rows, D, slot, eps, RANK: tl.constexpr,
                                WORLD: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                                USE_PDL: tl.constexpr = False):
    """_one_shot_all_reduce_rmsnorm's arithmetic over the Lamport protocol."""
    _pdl_begin(USE_PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(counter_ptr + pid) + 1
    base = (epoch % 2) * WORLD * slot
    cols = tl.arange(0, BLOCK)
    m = cols < D
    for row in range(pid, rows, nprog):
        v = _lamport_sanitize(tl.load(x_ptr + row * D + cols, mask=m), BITS)
        _lamport_push(v, buf_ptr, d0, d1, d2, d3, d4, d5, d6, d7, row * D + cols, m, base, slot,
                      RANK, WORLD)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    for row in range(pid, rows, nprog):
        acc = _lamport_sum(x_ptr, buf_ptr, row * D + cols, m, base, slot, RANK, WORLD, BLOCK, BITS)
        h = acc.to(x_ptr.dtype.element_ty) + tl.load(res_ptr + row * D + cols, mask=m, other=0.0)
        tl.store(res_ptr + row * D + cols, h, mask=m)
        hf = h.to(tl.float32)
        inv = tl.rsqrt(tl.sum(hf * hf, axis=0) / D + eps)
        tl.store(out_ptr + row * D + cols, (hf * inv * w).to(x_ptr.dtype.element_ty), mask=m)
    tl.store(counter_ptr + pid, epoch)


def _pdl_one_row(x: torch.Tensor) -> dict[str, bool]:
    """PDL for one-row steps, whose next kernel is the one-row GEMV: it streams its weights while
    this one waits for the peers. More rows are followed by cuBLAS, launched without PDL."""
    return _pdl_options(x) if x.dim() == 2 and x.shape[0] == 1 else {"USE_PDL": False}


class OneShotAllReduce:
    """In-place sum of a tensor over the TP ranks. Build with `create` (collective)."""

    def __init__(self, data: PeerBuffers, flags: PeerBuffers | None, rank: int, world: int,
                 max_bytes: int, programs: int = MAX_PROGRAMS) -> None:
        self.data, self.flags = data, flags  # no flags: the Lamport protocol
        self.rank, self.world = rank, world
        self.max_bytes = max_bytes
        self.grid = (programs,)  # every call, every rank: see the module's note on epochs
        self.counter = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=data.local.device)
        self._by_dtype: dict[torch.dtype, tuple[torch.Tensor, list[int]]] = {}

    @classmethod
    def create(cls, rank: int, world: int, cpu_group: Any, device: torch.device,
               max_bytes: int = DEFAULT_MAX_BYTES,
               protocol: str | None = None) -> OneShotAllReduce | None:
        """Every rank calls this together; None (every rank alike) where peer access is missing.
        protocol: "lamport" (the default) or "barrier"; MINISGL_ALL_REDUCE_PROTOCOL sets it."""
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
        if protocol == "lamport":
            data = exchange(2 * world * max_bytes, rank, world, cpu_group, device, fill=0xFF)
            return cls(data, None, rank, world, max_bytes, programs)
        data = exchange(2 * world * max_bytes, rank, world, cpu_group, device)
        flags = exchange(MAX_PROGRAMS * world * 4, rank, world, cpu_group, device)
        return cls(data, flags, rank, world, max_bytes, programs)

    def supports(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.dtype in _DTYPES and x.is_contiguous()
                and x.numel() * x.element_size() <= self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        if n == 0:
            return x
        buf, deltas = self._views(x.dtype)
        slot = self.max_bytes // x.element_size()  # elements
        grid = self.grid
        if self.flags is None:
            _lamport_all_reduce[grid](x, buf, *deltas, self.counter, n, slot, RANK=self.rank,
                                      WORLD=self.world, BLOCK=BLOCK, BITS=x.element_size() * 8,
                                      num_warps=4, **_pdl_one_row(x))
            return x
        _one_shot_all_reduce[grid](x, buf, *deltas, self.flags.ptrs, self.counter, n, slot,
                                   self.rank, WORLD=self.world, BLOCK=BLOCK, num_warps=4)
        return x

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
        """The sum of x over the ranks added into `residual` (in place), and RMSNorm of the new
        residual, in one kernel: x [N, D] and residual contiguous, `supports(x)`."""
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
            _lamport_all_reduce_rmsnorm[grid](
                x, residual, weight, out, buf, *deltas, self.counter, rows, d, slot, eps,
                RANK=self.rank, WORLD=self.world, BLOCK=block, BITS=x.element_size() * 8,
                num_warps=warps, **_pdl_one_row(x))
            return out
        _one_shot_all_reduce_rmsnorm[grid](
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
