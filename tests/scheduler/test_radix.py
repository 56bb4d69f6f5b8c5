"""The radix prefix cache on its own: matching, splitting, locking, LRU eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from minisgl_scheduler.pages import PageAllocator
from minisgl_scheduler.radix import RadixCache


def test_match_insert_split_and_pages_returned_exactly() -> None:
    c = RadixCache(page_size=2)
    node, have = c.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert have == 0 and c.total_pages == 3 and c.evictable_pages == 3
    assert c.match([1, 2, 3, 4, 5, 6, 7]).pages == [10, 11, 12]
    assert c.match([1, 2, 3, 4, 9, 9]).pages == [10, 11]  # splits the node after two pages
    assert c.match([1, 2, 3]).pages == [10]  # only whole pages match
    assert c.match([1, 3]).pages == []
    _, have = c.insert([1, 2, 3, 4, 7, 7], [20, 21, 22])
    assert have == 2  # the caller's 20, 21 duplicate what is cached; 22 now belongs to the tree
    assert c.match([1, 2, 3, 4, 7, 7]).pages == [10, 11, 22]
    assert c.total_pages == 4
    c.check()


def test_locked_prefixes_are_not_evicted_and_lru_goes_first() -> None:
    c = RadixCache(page_size=1)
    a, _ = c.insert([1, 2, 3], [0, 1, 2])
    b, _ = c.insert([1, 2, 7], [3, 4, 5])  # shares [1, 2]: the caller keeps its copies 3, 4
    c.match([1, 2, 7])  # b's branch is now the most recently used
    c.lock(b)
    assert c.evictable_pages == 1  # only page 2 (leaf "3") is unreferenced
    assert c.evict(5) == [2]
    assert c.match([1, 2, 3]).pages == [0, 1]
    c.unlock(b)
    assert sorted(c.evict(10)) == [0, 1, 5]
    assert c.total_pages == 0 and c.evictable_pages == 0
    with pytest.raises(RuntimeError):
        c.unlock(b)


def test_evict_trims_node_tails_exactly() -> None:
    c = RadixCache(page_size=1)
    c.insert([5, 6, 7, 8], [0, 1, 2, 3])
    assert c.evict(1) == [3]
    assert c.match([5, 6, 7, 8]).pages == [0, 1, 2]
    c.check()


def test_ready_step_blocks_matches_of_the_same_step() -> None:
    c = RadixCache(page_size=2)
    c.insert([1, 2], [0])
    c.insert([1, 2, 3, 4], [0, 1], ready_step=7)
    m = c.match([1, 2, 3, 4, 5], ready_before=7)
    assert m.pages == [0] and m.blocked
    m = c.match([1, 2, 3, 4, 5], ready_before=8)
    assert m.pages == [0, 1] and not m.blocked


SEQS = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=12), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(seqs=SEQS, page_size=st.sampled_from([1, 2, 3]), evict_every=st.integers(0, 4))
def test_random_inserts_match_a_reference_model(seqs: list[list[int]], page_size: int,
                                                evict_every: int) -> None:
    """Every cached page-aligned prefix maps to exactly the page inserted for it; evicted pages come
    back to the allocator once; nothing is leaked."""
    pool = PageAllocator(200)
    c = RadixCache(page_size)
    model: dict[tuple[int, ...], int] = {}  # whole-page prefix -> page holding its last page
    for i, seq in enumerate(seqs):
        n = len(seq) // page_size
        tokens = seq[: n * page_size]
        pages = pool.allocate(n)
        _, have = c.insert(tokens, pages)
        pool.free(pages[:have])  # duplicates of what the tree already had
        for k in range(have, n):
            key = tuple(tokens[: (k + 1) * page_size])
            assert key not in model
            model[key] = pages[k]
        if evict_every and i % evict_every == 0:
            evicted = c.evict(2)
            pool.free(evicted)
            for key in [k for k, p in model.items() if p in evicted]:
                del model[key]
        c.check()
        for seq2 in seqs:
            got = c.match(seq2).pages
            want = []
            for k in range(1, len(seq2) // page_size + 1):
                page = model.get(tuple(seq2[: k * page_size]))
                if page is None:
                    break
                want.append(page)
            assert got == want
    assert pool.num_free + c.total_pages == 200
    pool.free(c.evict_all())
    assert pool.num_free == 200 and c.total_pages == 0
