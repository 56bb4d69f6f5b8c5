"""The Triton kernels of the one-shot all-reduce (kernels/all_reduce.py says what they are for,
how epochs and buffer halves work, and launches them): the barrier protocol's copy, flag barrier
and sum, and the Lamport protocol's, each also fused with the residual add and RMSNorm.

Buffers, as every kernel here sees them: buf_ptr is this rank's buffer in the message's dtype,
rank r's buffer as mapped here is buf_ptr + d_r (`rank_delta`), and a buffer is
[2 epoch parities][WORLD slots][slot elements].
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import begin as _pdl_begin

# A rank that waits this long for a peer at the barrier (the peer died, or its process hangs)
# traps: a CUDA error in this process, so its step fails and the engine is seen to be lost,
# instead of a kernel that never ends. As long as the TP group's own collective timeout (a peer
# may legitimately lag by a first-use kernel compile).
TIMEOUT_NS: tl.constexpr = tl.constexpr(300 * 10**9)

@triton.jit
def rank_delta(r: tl.constexpr, d0, d1, d2, d3, d4, d5, d6, d7):
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
def store_norm_row(h, row, res_ptr, out_ptr, w, cols, m, D, eps):
    """The new residual row h (activation dtype) into the residual, and its RMSNorm times w
    (w in fp32) into out, with fused_kernels._rmsnorm_kernel's arithmetic: every fused
    all-reduce + norm kernel ends a row with this."""
    tl.store(res_ptr + row * D + cols, h, mask=m)
    hf = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(hf * hf, axis=0) / D + eps)
    tl.store(out_ptr + row * D + cols, (hf * inv * w).to(h.dtype), mask=m)


@triton.jit
def meet(flag_ptrs, pid, rank, value, WORLD: tl.constexpr):
    """Meet program `pid` of every other rank: each says `value` (which only grows), then waits
    until every peer has said at least as much."""
    # Every thread's stores are done before the flags say so (release is cumulative over
    # bar.sync); after the acquire, every thread's loads see the peers' stores.
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        if r != rank:
            peer_flags = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + pid * WORLD + rank, value, sem="release", scope="sys")
    my_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        if r != rank:
            seen = tl.atomic_add(my_flags + pid * WORLD + r, 0, sem="acquire", scope="sys")
            if seen < value:
                start = _now_ns()
                while seen < value:
                    if _now_ns() - start > TIMEOUT_NS:
                        _trap()  # the peer never came: fail the context, do not hang
                    seen = tl.atomic_add(my_flags + pid * WORLD + r, 0, sem="acquire",
                                         scope="sys")
    tl.debug_barrier()


@triton.jit
def _barrier(flag_ptrs, counter_ptr, pid, rank, epoch, WORLD: tl.constexpr):
    """Meet program `pid` of every other rank at `epoch`, then record the epoch."""
    meet(flag_ptrs, pid, rank, epoch, WORLD)
    tl.store(counter_ptr + pid, epoch)


@triton.jit
def barrier_all_reduce(x_ptr, buf_ptr, d0, d1, d2, d3, d4, d5, d6, d7, flag_ptrs,
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
            dst = buf_ptr + rank_delta(r, d0, d1, d2, d3, d4, d5, d6, d7) + base
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
def barrier_all_reduce_rmsnorm(x_ptr, res_ptr, w_ptr, out_ptr, buf_ptr, d0, d1, d2, d3, d4, d5,
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
            dst = buf_ptr + rank_delta(r, d0, d1, d2, d3, d4, d5, d6, d7) + base
            tl.store(dst + rank * slot + row * D + cols, v, mask=m)
    _barrier(flag_ptrs, counter_ptr, pid, rank, epoch, WORLD)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    for row in range(pid, rows, nprog):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            acc += tl.load(buf_ptr + base + r * slot + row * D + cols, mask=m, other=0.0,
                           cache_modifier=".cg").to(tl.float32)
        h = acc.to(x_ptr.dtype.element_ty) + tl.load(res_ptr + row * D + cols, mask=m, other=0.0)
        store_norm_row(h, row, res_ptr, out_ptr, w, cols, m, D, eps)


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
            dst = buf_ptr + rank_delta(r, d0, d1, d2, d3, d4, d5, d6, d7) + base
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
def lamport_all_reduce(x_ptr, buf_ptr, d0, d1, d2, d3, d4, d5, d6, d7, counter_ptr, n, slot,
                        workers, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                        BITS: tl.constexpr, USE_PDL: tl.constexpr = False):
    # PDL: every program is resident when it releases the next kernel, so none waits on that one.
    # Programs from `workers` on only count the call (the launcher's note on the grid).
    _pdl_begin(USE_PDL)
    pid = tl.program_id(0)
    nprog = workers
    epoch = tl.load(counter_ptr + pid) + 1
    base = (epoch % 2) * WORLD * slot
    cols = tl.arange(0, BLOCK)
    first = tl.where(pid < workers, pid * BLOCK, n)
    for start in range(first, n, nprog * BLOCK):
        offs = tl.multiple_of(start, BLOCK) + cols
        m = offs < n
        v = _lamport_sanitize(tl.load(x_ptr + offs, mask=m), BITS)
        _lamport_push(v, buf_ptr, d0, d1, d2, d3, d4, d5, d6, d7, offs, m, base, slot, RANK, WORLD)
    for start in range(first, n, nprog * BLOCK):
        offs = tl.multiple_of(start, BLOCK) + cols
        m = offs < n
        acc = _lamport_sum(x_ptr, buf_ptr, offs, m, base, slot, RANK, WORLD, BLOCK, BITS)
        tl.store(x_ptr + offs, acc.to(x_ptr.dtype.element_ty), mask=m)
    tl.store(counter_ptr + pid, epoch)


@triton.jit
def lamport_all_reduce_rmsnorm(x_ptr, res_ptr, w_ptr, out_ptr, buf_ptr, d0, d1, d2, d3, d4, d5,
                                d6, d7, counter_ptr, rows, D, slot, eps, workers,
                                RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                                BITS: tl.constexpr, USE_PDL: tl.constexpr = False):
    """barrier_all_reduce_rmsnorm's arithmetic over the Lamport protocol."""
    _pdl_begin(USE_PDL)
    pid = tl.program_id(0)
    nprog = workers
    epoch = tl.load(counter_ptr + pid) + 1
    base = (epoch % 2) * WORLD * slot
    cols = tl.arange(0, BLOCK)
    m = cols < D
    first = tl.where(pid < workers, pid, rows)
    for row in range(first, rows, nprog):
        v = _lamport_sanitize(tl.load(x_ptr + row * D + cols, mask=m), BITS)
        _lamport_push(v, buf_ptr, d0, d1, d2, d3, d4, d5, d6, d7, row * D + cols, m, base, slot,
                      RANK, WORLD)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    for row in range(first, rows, nprog):
        acc = _lamport_sum(x_ptr, buf_ptr, row * D + cols, m, base, slot, RANK, WORLD, BLOCK, BITS)
        h = acc.to(x_ptr.dtype.element_ty) + tl.load(res_ptr + row * D + cols, mask=m, other=0.0)
        store_norm_row(h, row, res_ptr, out_ptr, w, cols, m, D, eps)
    tl.store(counter_ptr + pid, epoch)
