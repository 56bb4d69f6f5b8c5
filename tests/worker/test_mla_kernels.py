"""The MLA Triton kernels (kernels/mla_attention.py) under the interpreter, fp32, against an exact
reference: every head attends to one shared cached row a token (latent + rotary key), the values
are the latent part. Ragged lengths, pages scattered, split-K, chunked prefixes."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_worker.kernels import mla_attention, paged_decode  # noqa: E402

for _mod in (paged_decode, mla_attention):
    if not any(type(v).__name__ == "InterpretedFunction" for v in vars(_mod).values()):
        importlib.reload(_mod)

V, R, H = 32, 16, 20  # 20 heads: two head blocks of 16, the second part-masked


def _pool(lens: list[int], page_size: int, seed: int):  # noqa: ANN202
    gen = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_per) + 2
    cache = torch.randn(num_pages, page_size, 1, V + R, generator=gen)
    order = torch.randperm(num_pages, generator=gen)
    table = torch.randint(0, num_pages, (len(lens) + 1, max(pages_per) + 1), generator=gen,
                          dtype=torch.int32)
    rows = torch.arange(1, len(lens) + 1, dtype=torch.int32)  # row 0 left as garbage
    used = 0
    for b, n in enumerate(pages_per):
        table[rows[b], :n] = order[used:used + n].to(torch.int32)
        used += n
    return cache, table, rows


def _rows_of(cache, table, row: int, n: int, page_size: int) -> torch.Tensor:  # noqa: ANN001
    t = torch.arange(n)
    return cache[table[row].long()[t // page_size], t % page_size, 0]  # [n, V + R]


def _reference(q: torch.Tensor, kv: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    """q [m, H, V + R] at positions prefix.. over kv [prefix + m, V + R]."""
    scores = torch.einsum("qhd,kd->hqk", q.double(), kv.double()) * scale
    q_pos = prefix + torch.arange(q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(kv.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,kd->qhd", scores.softmax(-1), kv[:, :V].double()).float()


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("splits", [1, 4])
def test_mla_decode_matches_reference(page_size: int, splits: int) -> None:
    lens = [1, 37, 5, 70]
    cache, table, rows = _pool(lens, page_size, seed=page_size + splits)
    q = torch.randn(len(lens), H, V + R, generator=torch.Generator().manual_seed(1))
    out = mla_attention.mla_decode(q, cache, V, table, rows, torch.tensor(lens, dtype=torch.int32),
                                   0.2, splits, block_n=16)
    for b, n in enumerate(lens):
        kv = _rows_of(cache, table, int(rows[b]), n, page_size)
        torch.testing.assert_close(out[b], _reference(q[b:b + 1], kv, n - 1, 0.2)[0],
                                   atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("page_size", [1, 4])
def test_mla_extend_matches_reference(page_size: int) -> None:
    reqs = [(0, 7), (13, 5), (3, 1), (20, 19)]
    lens = [p + n for p, n in reqs]
    cache, table, rows = _pool(lens, page_size, seed=7)
    new = [n for _, n in reqs]
    q = torch.randn(sum(new), H, V + R, generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    prefix = torch.tensor([p for p, _ in reqs], dtype=torch.int32)
    out = mla_attention.mla_extend(q, cache, V, table, rows, cu, prefix, max(new), 0.3,
                                   block_m=16, block_n=16)
    for b, (p, n) in enumerate(reqs):
        kv = _rows_of(cache, table, int(rows[b]), p + n, page_size)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]], _reference(q[cu[b]:cu[b + 1]], kv, p, 0.3),
                                   atol=2e-5, rtol=2e-5)


def test_widths_padded_to_blocks() -> None:
    """The tiny test models' widths (latent 24, rotary 8): each part padded to its block."""
    v, r = 24, 8
    lens = [9, 3]
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(6, 4, 1, v + r, generator=gen)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    rows = torch.tensor([0, 1], dtype=torch.int32)
    q = torch.randn(2, 3, v + r, generator=gen)
    out = mla_attention.mla_decode(q, cache, v, table, rows, torch.tensor(lens, dtype=torch.int32),
                                   0.4, 2, block_n=16)
    for b, n in enumerate(lens):
        t = torch.arange(n)
        kv = cache[table[b].long()[t // 4], t % 4, 0]
        scores = torch.einsum("hd,kd->hk", q[b].double(), kv.double()) * 0.4
        ref = (scores.softmax(-1) @ kv[:, :v].double()).float()
        torch.testing.assert_close(out[b], ref, atol=2e-5, rtol=2e-5)
