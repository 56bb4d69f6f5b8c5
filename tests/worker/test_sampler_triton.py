"""The fused Triton draw (the GPU path of the sampler) under the interpreter: the same tokens as
the torch reference, whose hash bits it must reproduce exactly."""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402
from minisgl_worker.kernels import sampling as tsampling  # noqa: E402
from minisgl_worker.sampling import ops  # noqa: E402

if type(tsampling._gumbel_argmax_kernel).__name__ != "InterpretedFunction":
    importlib.reload(tsampling)


def test_triton_draw_equals_torch_reference():
    gen = torch.Generator().manual_seed(0)
    batch, vocab = 6, 2500  # several blocks per chunk and a ragged tail
    x = torch.randn(batch, vocab, generator=gen) * 2
    x[1, ::3] = -math.inf  # filtered tokens
    x[2, :] = -math.inf
    x[2, 1234] = 0.5  # a single survivor
    seeds = torch.randint(0, 2**63 - 1, (batch,), generator=gen)
    seeds[0] = 2**63 - 1  # the extremes of the seed range
    seeds[1] = 0
    positions = torch.arange(batch) * 1000 + 7
    keys = ops.row_keys(seeds, positions)
    expect = ops.gumbel_argmax_torch(x, keys, ops.token_hashes(vocab, x.device))
    for chunks in (1, 3):
        got = tsampling.gumbel_argmax(x, seeds, positions, num_chunks=chunks)
        assert got.tolist() == expect.tolist()
    assert int(expect[2]) == 1234 and int(expect[1]) % 3 != 0


def test_triton_ties_pick_the_lowest_index():
    x = torch.full((1, 3000), -math.inf)
    x[0, [5, 2100]] = 1e30  # noise cannot separate these: a tie
    seeds, positions = torch.tensor([7]), torch.tensor([3])
    assert int(tsampling.gumbel_argmax(x, seeds, positions, num_chunks=2)) == 5
    keys = ops.row_keys(seeds, positions)
    assert int(ops.gumbel_argmax_torch(x, keys, ops.token_hashes(3000, x.device))) == 5
