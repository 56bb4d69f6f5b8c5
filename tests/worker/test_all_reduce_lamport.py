"""The Lamport all-reduce kernels (kernels/all_reduce_kernels.py) under the Triton interpreter (CPU).

Two ranks' IPC buffers are emulated as two halves of one tensor, and the ranks run one after the
other: rank 1's stores into rank 0's buffer are placed first (what rank 1's kernel does before it
polls), then rank 0's kernel runs (it must find them, sum and leave its buffer EMPTY again), then
rank 1's kernel (it must find what rank 0 stored and give bit-identical sums). The concurrent
case runs on two GPUs: tests/gpu/test_all_reduce.py.
"""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_worker.kernels import all_reduce, all_reduce_kernels  # noqa: E402

if type(all_reduce_kernels.lamport_all_reduce).__name__ != "InterpretedFunction":
    importlib.reload(all_reduce_kernels)  # imported earlier in this process without the interpreter

WORLD = 2
SLOT_BYTES = 8192  # max_bytes: one rank's slot
GRID = 2 * all_reduce.MAX_PROGRAMS  # as OneShotAllReduce launches them (two an SM at most)


class TwoRanks:
    """Both ranks' buffers ([2 parities][2 slots][slot]) in one allocation, all bytes EMPTY."""

    def __init__(self) -> None:
        self.per_rank = 2 * WORLD * SLOT_BYTES
        self.mem = torch.full((WORLD * self.per_rank,), 0xFF, dtype=torch.uint8)
        self.counters = [torch.zeros(GRID, dtype=torch.int32) for _ in range(WORLD)]

    def buf(self, rank: int, dtype: torch.dtype) -> torch.Tensor:
        return self.mem[rank * self.per_rank:(rank + 1) * self.per_rank].view(dtype)

    def deltas(self, rank: int, dtype: torch.dtype) -> list[int]:
        size = torch.empty((), dtype=dtype).element_size()
        own = self.buf(rank, dtype).data_ptr()
        return [(self.buf(r, dtype).data_ptr() - own) // size for r in range(WORLD)] + [0] * 6

    def slot(self, rank: int, parity: int, src: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        """rank's buffer, region where `src` stores a message of n elements at `parity`."""
        slot = SLOT_BYTES // torch.empty((), dtype=dtype).element_size()
        start = (parity * WORLD + src) * slot
        return self.buf(rank, dtype)[start:start + n]

    def empty(self, rank: int) -> bool:
        return bool((self.mem[rank * self.per_rank:(rank + 1) * self.per_rank] == 0xFF).all())


def _sanitized(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(x), torch.full_like(x, float("nan")), x)


def _flat(ranks: TwoRanks, rank: int, x: torch.Tensor, block: int, workers: int) -> None:
    n = x.numel()
    all_reduce_kernels.lamport_all_reduce[(GRID,)](
        x, ranks.buf(rank, x.dtype), *ranks.deltas(rank, x.dtype), ranks.counters[rank], n,
        SLOT_BYTES // x.element_size(), workers, RANK=rank, WORLD=WORLD, BLOCK=block,
        BITS=x.element_size() * 8)


# workers: the whole grid moves data (two programs an SM), or half of it (one an SM: the other
# half only counts the call)
@pytest.mark.parametrize("workers", [GRID, GRID // 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 100, 1000])
def test_lamport_flat_sums_alike_on_both_ranks(dtype: torch.dtype, n: int, workers: int) -> None:
    ranks = TwoRanks()
    for call in range(3):  # epochs 1, 2, 3: both parities, then the first again
        g = torch.Generator().manual_seed(100 * call + n)
        x0 = torch.randint(-8, 8, (n,), generator=g).to(dtype)
        x1 = torch.randint(-8, 8, (n,), generator=g).to(dtype)
        if n > 1:  # an input holding the EMPTY bit pattern must not look unsent
            x0.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[-1] = -1
        want = (_sanitized(x0).float() + x1.float()).to(dtype)
        parity = (call + 1) % 2
        ranks.slot(0, parity, 1, n, dtype).copy_(x1)  # rank 1's stores, ahead of rank 0
        out0, out1 = x0.clone(), x1.clone()
        _flat(ranks, 0, out0, block=64, workers=workers)
        assert torch.equal(out0, want) or (n > 1 and torch.equal(out0[:-1], want[:-1])
                                           and torch.isnan(out0[-1]))
        assert ranks.empty(0), "rank 0 must leave its buffer EMPTY"
        sent = ranks.slot(1, parity, 0, n, dtype)
        assert torch.equal(sent[:-1], x0[:-1]) and not torch.equal(
            sent[-1:].view(torch.uint8), torch.full_like(sent[-1:].view(torch.uint8), 0xFF))
        _flat(ranks, 1, out1, block=64, workers=workers)
        assert torch.equal(out1.view(torch.uint8), out0.view(torch.uint8)), "ranks differ"
        assert ranks.empty(1)
        ranks.slot(0, parity, 1, n, dtype).view(torch.uint8).fill_(0xFF)  # rank 1's re-send
    assert all(bool((c == 3).all()) for c in ranks.counters)  # every program counts each call


# (200, 16): more rows than working programs, so each of those takes several
@pytest.mark.parametrize("rows,d,workers", [(1, 64, GRID), (5, 96, GRID), (200, 16, GRID // 2)])
def test_lamport_add_rmsnorm_matches_reference(rows: int, d: int, workers: int) -> None:
    # fp16, not bf16: the interpreter adds two bf16 tensors as their integer bit patterns.
    ranks, dtype, eps = TwoRanks(), torch.float16, 1e-6
    g = torch.Generator().manual_seed(rows * d)
    x = [torch.randn(rows, d, generator=g).to(dtype) for _ in range(WORLD)]
    res = torch.randn(rows, d, generator=g).to(dtype)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype)
    summed = (x[0].float() + x[1].float()).to(dtype)
    want_res = summed + res
    hf = want_res.float()
    want_out = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(dtype)
    ranks.slot(0, 1, 1, rows * d, dtype).copy_(x[1].flatten())
    outs, residuals = [], []
    for rank in range(WORLD):
        r, out = res.clone(), torch.empty_like(res)
        all_reduce_kernels.lamport_all_reduce_rmsnorm[(GRID,)](
            x[rank], r, w, out, ranks.buf(rank, dtype), *ranks.deltas(rank, dtype),
            ranks.counters[rank], rows, d, SLOT_BYTES // 2, eps, workers, RANK=rank,
            WORLD=WORLD, BLOCK=triton_block(d), BITS=16)
        outs.append(out)
        residuals.append(r)
        if rank == 0:
            assert ranks.empty(0)
    assert torch.equal(residuals[0], want_res) and torch.equal(residuals[1], want_res)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], want_out, rtol=2e-2, atol=2e-2)
    assert ranks.empty(1)
    assert all(bool((c == 1).all()) for c in ranks.counters)


def triton_block(d: int) -> int:
    return 1 << (d - 1).bit_length()
