"""The scheduler's prefix event log against its radix tree: a subscriber that applies the events
holds exactly the tree's page hashes, resumes without a snapshot while the ring holds its place,
and gets a snapshot when it fell behind or nobody was subscribed in between."""

from __future__ import annotations

import random

from minisgl_core.prefix_hash import page_hashes
from minisgl_scheduler.prefix_events import PrefixEventLog
from minisgl_scheduler.radix import RadixCache

PS = 4


def _apply(index: set[int], log: PrefixEventLog, cursor: int) -> int:
    batches = log.since(cursor, 0.0)
    assert batches is not None
    for b in batches:
        assert b.seq == cursor + 1, "gap in the seq numbers"
        index |= set(b.stored)
        index -= set(b.removed)
        cursor = b.seq
    return cursor


def _tree_hashes(cache: RadixCache, log: PrefixEventLog) -> set[int]:
    return set(log.snapshot(cache)[1])


def test_events_track_the_tree_through_inserts_splits_and_evictions() -> None:
    rng = random.Random(7)
    cache = RadixCache(PS)
    log = PrefixEventLog(PS)
    cache.listener = log
    sub = log.subscribe(0, cache)
    assert sub.snapshot == []
    index: set[int] = set()
    cursor = sub.cursor
    next_page = 0
    prefixes = [[rng.randrange(50) for _ in range(PS * 6)] for _ in range(4)]
    for step in range(200):
        base = prefixes[rng.randrange(len(prefixes))]
        tokens = base[: PS * rng.randrange(1, 6)] + [rng.randrange(50) for _ in range(PS * 2)]
        n = len(tokens) // PS
        pages = list(range(next_page, next_page + n))
        next_page += n
        cache.insert(tokens, pages)
        if step % 7 == 0:
            cache.evict(rng.randrange(1, 12))
        log.flush()
        cursor = _apply(index, log, cursor)
        assert index == _tree_hashes(cache, log)
    # A prompt's hashes name exactly the pages the tree would match for it.
    probe = prefixes[0][: PS * 3]
    matched = cache.match(probe).num_pages
    hashes = page_hashes(probe, PS)
    assert sum(1 for h in hashes[:matched] if h in index) == matched


def test_resume_inside_the_ring_and_snapshot_after_falling_behind() -> None:
    cache = RadixCache(PS)
    log = PrefixEventLog(PS, ring_batches=4)
    cache.listener = log
    first = log.subscribe(0, cache)
    cache.insert(list(range(PS * 2)), [0, 1])
    log.flush()
    cursor = _apply(set(), log, first.cursor)
    resumed = log.subscribe(cursor, cache)
    assert resumed.snapshot is None and resumed.cursor == cursor == 1
    for k in range(6):  # more batches than the ring keeps
        cache.insert([100 + k] * PS, [10 + k])
        log.flush()
    assert log.since(cursor, 0.0) is None
    behind = log.subscribe(cursor, cache)
    assert behind.snapshot is not None and set(behind.snapshot) == _tree_hashes(cache, log)


def test_no_subscriber_records_nothing_and_breaks_resume() -> None:
    cache = RadixCache(PS)
    log = PrefixEventLog(PS)
    cache.listener = log
    sub = log.subscribe(0, cache)
    log.unsubscribe()
    cache.insert(list(range(PS)), [0])
    log.flush()
    assert not log._pending and not log._ring
    again = log.subscribe(sub.cursor, cache)
    assert again.snapshot == page_hashes(list(range(PS)), PS)
