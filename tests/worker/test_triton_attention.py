"""The paged-attention and KV-store Triton kernels under the interpreter (CPU), fp32, against an
exact torch reference: ragged lengths, page sizes 1-128, GQA, chunked prefixes, split-K."""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_worker.kernels import paged_decode, paged_extend, store_kv  # noqa: E402

for _mod in (paged_decode, paged_extend, store_kv):
    if not any(type(v).__name__ == "InterpretedFunction" for v in vars(_mod).values()):
        importlib.reload(_mod)  # imported earlier in this process without the interpreter

HEAD_DIM = 16  # tl.dot's minimum on GPUs; the kernels are written for that constraint


class Pool:
    """A random paged KV pool holding `lens[b]` tokens for request b in page-table row rows[b]:
    pages scattered over the pool, spare rows and spare page-table columns left as garbage."""

    def __init__(self, lens: list[int], page_size: int, num_kv_heads: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.page_size, self.lens = page_size, lens
        pages_per = [-(-n // page_size) for n in lens]
        num_pages = sum(pages_per) + 3
        shape = (num_pages, page_size, num_kv_heads, HEAD_DIM)
        self.k = torch.randn(shape, generator=gen)
        self.v = torch.randn(shape, generator=gen)
        order = torch.randperm(num_pages, generator=gen)
        num_rows = len(lens) + 2
        self.rows = torch.randperm(num_rows, generator=gen)[: len(lens)].to(torch.int32)
        self.table = torch.randint(0, num_pages, (num_rows, max(pages_per) + 2), generator=gen,
                                   dtype=torch.int32)
        used = 0
        for b, n in enumerate(pages_per):
            self.table[self.rows[b], :n] = order[used : used + n].to(torch.int32)
            used += n

    def kv_of(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[L, Hkv, D] keys and values of request b, in token order."""
        t = torch.arange(self.lens[b])
        pages = self.table[self.rows[b]].long()[t // self.page_size]
        return self.k[pages, t % self.page_size], self.v[pages, t % self.page_size]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
              scale: float, window: int | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D] at positions prefix.. attending causally over k, v [prefix + n, Hkv, D];
    `window`: keys more than window - 1 back masked; `sinks` [H]: an extra logit a head."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = prefix + torch.arange(q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    hidden = (k_pos > q_pos) | (k_pos <= q_pos - window if window else False)
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.double()).float()


@pytest.mark.parametrize("page_size", [1, 4, 16, 64, 128])  # 64, 128: one page id a block
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 1), (6, 2)])
def test_decode_matches_reference(page_size: int, num_heads: int, num_kv_heads: int):
    lens = [1, 37, 5, 70, 16]
    pool = Pool(lens, page_size, num_kv_heads, seed=page_size * 10 + num_heads + num_kv_heads)
    q = torch.randn(len(lens), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    expect = torch.stack([reference(q[b : b + 1], *pool.kv_of(b), lens[b] - 1, scale)[0]
                          for b in range(len(lens))])
    for splits in (1, 4):  # one split, and split-K with empty splits for the short rows
        out = paged_decode.paged_decode(q, pool.k, pool.v, pool.table, pool.rows, seq_lens,
                                        scale, num_splits=splits, block_n=16)
        torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_decode_over_fp8_cache_in_fp16(q_dtype: torch.dtype, kv_dtype: torch.dtype):
    """A 16-bit q over an fp8 cache: the kernel's products run in fp16 (K/V upcast exactly);
    within fp16 rounding of the probabilities of the exact result over the cached values."""
    lens = [1, 37, 70, 16]
    pool = Pool(lens, 4, 2, seed=5)
    pool.k, pool.v = pool.k.to(kv_dtype), pool.v.to(kv_dtype)
    q = torch.randn(len(lens), 4, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    q = q.to(q_dtype)
    scale = HEAD_DIM**-0.5
    expect = torch.stack([reference(q[b : b + 1].float(), *(x.float() for x in pool.kv_of(b)),
                                    lens[b] - 1, scale)[0] for b in range(len(lens))])
    out = paged_decode.paged_decode(q, pool.k, pool.v, pool.table, pool.rows,
                                    torch.tensor(lens, dtype=torch.int32), scale, num_splits=2,
                                    block_n=16)
    assert out.dtype == q_dtype
    torch.testing.assert_close(out.float(), expect, atol=1e-2, rtol=1e-2)


def test_decode_zero_length_row_and_workspace():
    """A padded row (seq_len 0) gives zeros; a preallocated, larger workspace is used as is."""
    lens = [9, 3]
    pool = Pool(lens, 4, 2)
    q = torch.randn(3, 4, HEAD_DIM)
    rows = torch.cat([pool.rows, pool.rows[:1]])
    seq_lens = torch.tensor(lens + [0], dtype=torch.int32)
    ws = (torch.full((8, 4, 2, HEAD_DIM), float("nan")), torch.full((8, 4, 2), float("nan")))
    out = paged_decode.paged_decode(q, pool.k, pool.v, pool.table, rows, seq_lens, 0.3,
                                    num_splits=2, block_n=16, workspace=ws)
    assert torch.equal(out[2], torch.zeros(4, HEAD_DIM))
    expect = reference(q[1:2], *pool.kv_of(1), 2, 0.3)[0]
    torch.testing.assert_close(out[1], expect, atol=2e-5, rtol=2e-5)
    # One split writes the answer itself: every element of `out`, the workspace left alone.
    ws = (torch.full((8, 4, 1, HEAD_DIM), float("nan")), torch.full((8, 4, 1), float("nan")))
    direct = paged_decode.paged_decode(q, pool.k, pool.v, pool.table, rows, seq_lens, 0.3,
                                       num_splits=1, block_n=16, workspace=ws,
                                       out=torch.full_like(q, float("nan")))
    assert torch.equal(direct[2], torch.zeros(4, HEAD_DIM))
    torch.testing.assert_close(direct, out, atol=2e-5, rtol=2e-5)
    assert bool(ws[0].isnan().all()) and bool(ws[1].isnan().all())


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_in_any_start_order_gives_the_same_output(num_splits: int):
    """`order` only changes which programs start first (longest first, in the engine): every
    row's output is bit for bit the one of the natural order, with the merge too."""
    lens = [5, 40, 16, 33, 1]
    pool = Pool(lens, 4, 2, seed=3)
    q = torch.randn(len(lens), 4, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    natural = paged_decode.paged_decode(q, pool.k, pool.v, pool.table, pool.rows, seq_lens,
                                        0.3, num_splits=num_splits, block_n=16)
    longest = torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
    for order in (longest, torch.tensor([4, 2, 0, 3, 1], dtype=torch.int32)):
        out = paged_decode.paged_decode(q, pool.k, pool.v, pool.table, pool.rows, seq_lens,
                                        0.3, num_splits=num_splits, block_n=16, order=order)
        assert torch.equal(out, natural)


def test_decode_empty_splits_are_neither_written_nor_read():
    """A split count sized for long contexts over short rows (a CUDA graph's): the splits past a
    row's KV store no partials and the merge reads only those that hold tokens, so a workspace
    full of NaN stays NaN there and the output is still exact."""
    lens = [5, 40, 16]  # blocks of 16: 1, 3 and 1 of the 8 splits hold tokens
    pool = Pool(lens, 4, 2, seed=7)
    q = torch.randn(len(lens), 4, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    ws = (torch.full((3, 4, 8, HEAD_DIM), float("nan")), torch.full((3, 4, 8), float("nan")))
    out = paged_decode.paged_decode(q, pool.k, pool.v, pool.table, pool.rows,
                                    torch.tensor(lens, dtype=torch.int32), 0.3, num_splits=8,
                                    block_n=16, workspace=ws)
    expect = torch.stack([reference(q[b : b + 1], *pool.kv_of(b), lens[b] - 1, 0.3)[0]
                          for b in range(len(lens))])
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)
    for b, used in enumerate((1, 3, 1)):
        assert not ws[1][b, :, :used].isnan().any()
        assert bool(ws[1][b, :, used:].isnan().all()) and bool(ws[0][b, :, used:].isnan().all())


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 1), (6, 3)])
def test_extend_matches_reference(page_size: int, num_heads: int, num_kv_heads: int):
    # (prefix, new): a fresh prefill, chunked prefills with cached prefixes, a decode row,
    # and a chunk longer than one query block.
    reqs = [(0, 7), (13, 5), (3, 1), (0, 1), (20, 19), (16, 16)]
    lens = [p + n for p, n in reqs]
    pool = Pool(lens, page_size, num_kv_heads, seed=page_size + 7 * num_heads)
    new = [n for _, n in reqs]
    q = torch.randn(sum(new), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0] + new, dtype=torch.int32).cumsum(0).to(torch.int32)
    prefix = torch.tensor([p for p, _ in reqs], dtype=torch.int32)
    scale = 0.37
    out = paged_extend.paged_extend(q, pool.k, pool.v, pool.table, pool.rows, cu, prefix,
                                    max(new), scale, block_m=16, block_n=16)
    for b, (p, _) in enumerate(reqs):
        expect = reference(q[cu[b] : cu[b + 1]], *pool.kv_of(b), p, scale)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]], expect, atol=2e-5, rtol=2e-5)


def test_extend_empty_batch_and_untouched_padding():
    pool = Pool([4], 4, 1)
    q = torch.randn(0, 2, HEAD_DIM)
    empty = torch.zeros(0, dtype=torch.int32)
    out = paged_extend.paged_extend(q, pool.k, pool.v, pool.table, empty,
                                    torch.zeros(1, dtype=torch.int32), empty, 0, 1.0)
    assert out.shape == (0, 2, HEAD_DIM)


@pytest.mark.parametrize(("window", "with_sinks"), [(8, False), (20, True), (None, True),
                                                     (1, False)])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_window_and_sinks_match_reference(window: int | None, with_sinks: bool,
                                                 splits: int):
    """Sliding windows shorter and longer than rows, with and without sinks, one split and
    split-K (the sink enters in the merge)."""
    lens = [1, 37, 5, 70, 16]
    pool = Pool(lens, 4, 2, seed=11)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(len(lens), 4, HEAD_DIM, generator=gen)
    sinks = torch.randn(4, generator=gen) * 2 if with_sinks else None
    expect = torch.stack([reference(q[b : b + 1], *pool.kv_of(b), lens[b] - 1, 0.3, window,
                                    sinks)[0] for b in range(len(lens))])
    out = paged_decode.paged_decode(q, pool.k, pool.v, pool.table, pool.rows,
                                    torch.tensor(lens, dtype=torch.int32), 0.3,
                                    num_splits=splits, block_n=16, window=window, sinks=sinks)
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("window", "with_sinks"), [(8, False), (5, True), (None, True),
                                                     (1, False), (40, False)])
def test_extend_window_and_sinks_match_reference(window: int | None, with_sinks: bool):
    """Windows that start inside a chunk, inside the cached prefix and before position 0,
    across query blocks (block_m 16 < the 19- and 33-token chunks)."""
    reqs = [(0, 7), (13, 5), (3, 1), (20, 19), (16, 33)]
    lens = [p + n for p, n in reqs]
    pool = Pool(lens, 4, 2, seed=13)
    new = [n for _, n in reqs]
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(sum(new), 4, HEAD_DIM, generator=gen)
    sinks = torch.randn(4, generator=gen) * 2 if with_sinks else None
    cu = torch.tensor([0] + new, dtype=torch.int32).cumsum(0).to(torch.int32)
    prefix = torch.tensor([p for p, _ in reqs], dtype=torch.int32)
    out = paged_extend.paged_extend(q, pool.k, pool.v, pool.table, pool.rows, cu, prefix,
                                    max(new), 0.37, block_m=16, block_n=16, window=window,
                                    sinks=sinks)
    for b, (p, _) in enumerate(reqs):
        expect = reference(q[cu[b] : cu[b + 1]], *pool.kv_of(b), p, 0.37, window, sinks)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]], expect, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_store_kv_writes_only_its_slots(page_size: int):
    gen = torch.Generator().manual_seed(page_size)
    num_pages, hkv = 6, 3
    k_cache = torch.randn(num_pages, page_size, hkv, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_pages, page_size, hkv, HEAD_DIM, generator=gen)
    total = num_pages * page_size
    loc = torch.randperm(total, generator=gen)[: min(5, total - 1)]
    loc = torch.cat([loc, torch.tensor([-1])])  # a padded row that must write nowhere
    # k, v as strided views of a fused qkv-like buffer, as a model would produce them.
    kv = torch.randn(len(loc), 2, hkv, HEAD_DIM, generator=gen)
    k, v = kv[:, 0], kv[:, 1]
    ek, ev = k_cache.clone(), v_cache.clone()
    ek.view(-1, hkv, HEAD_DIM)[loc[:-1]] = k[:-1]
    ev.view(-1, hkv, HEAD_DIM)[loc[:-1]] = v[:-1]
    store_kv.store_kv(k_cache, v_cache, k, v, loc)
    assert torch.equal(k_cache, ek) and torch.equal(v_cache, ev)


def test_choose_num_splits():
    assert paged_decode.choose_num_splits(256, 8, 100) == 1
    assert paged_decode.choose_num_splits(256, 8, 40960) == 1  # a full batch: no merge
    assert paged_decode.choose_num_splits(64, 8, 40960) == 1  # 512 programs
    assert paged_decode.choose_num_splits(32, 8, 40960) == 2
    assert paged_decode.choose_num_splits(128, 4, 40960) == 1
    assert paged_decode.choose_num_splits(64, 4, 40960) == 2  # 256 programs
    assert paged_decode.choose_num_splits(48, 4, 40960) == 2  # 192 programs: rounds down
    assert paged_decode.choose_num_splits(256, 2, 40960) == 1
    assert paged_decode.choose_num_splits(1, 8, 32768) == 32
    assert paged_decode.choose_num_splits(4, 8, 1000) == 4  # capped by the 256-token slices
    assert paged_decode.choose_num_splits(16, 8, 200) == 1  # one slice: no split
    for b in (1, 3, 17, 300):
        n = paged_decode.choose_num_splits(b, 2, 5000)
        assert n & (n - 1) == 0 and 1 <= n <= paged_decode.MAX_SPLITS
