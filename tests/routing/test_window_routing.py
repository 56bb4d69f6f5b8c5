"""Cache-aware routing to engines with sliding-window layers: the Watch stream reports which cached
pages still have their window-pool KV, and the gateway's view scores a prefix only as far as the
engine's own match would use it (kv_window.usable_pages), not the full-attention pages alone."""

from __future__ import annotations

import random

from minisgl_core.prefix_hash import page_hashes
from minisgl_core.proto.minisgl.v1 import scheduler_pb2
from minisgl_gateway.upstream.engine_view import EngineView
from minisgl_gateway.upstream.routing import Router
from minisgl_scheduler.kv_window import usable_pages
from minisgl_scheduler.prefix_events import PrefixEventLog
from minisgl_scheduler.radix import RadixCache

PS, WINDOW = 4, 10  # a query reads its 9 predecessors: up to three pages back


def _feed(view: EngineView, log: PrefixEventLog, cache: RadixCache, window: int) -> None:
    """What a WatchStream sends the view: the batches since its seq, as messages."""
    batches = log.since(view.seq, 0.0)
    assert batches is not None
    for b in batches:
        ok = view.apply(scheduler_pb2.WatchResponse(
            seq=b.seq, stored=b.stored, removed=b.removed, window_stored=b.window_stored,
            window_removed=b.window_removed, page_size=PS, window=window))
        assert ok


def test_a_prefix_whose_window_pages_are_gone_scores_as_a_shorter_hit() -> None:
    prompt = list(range(100, 140))  # 10 pages
    hashes = page_hashes(prompt, PS)
    full, evicted = EngineView("a:1", up=True), EngineView("b:1", up=True)
    for view in (full, evicted):
        view.apply(scheduler_pb2.WatchResponse(seq=1, snapshot=True, stored=hashes[:8],
                                               window_stored=hashes[:8], page_size=PS,
                                               window=WINDOW))
    assert full.window == WINDOW and full.matched_pages(hashes, 0.0) == 8
    # b's engine evicted the window KV of pages 5 and 6 (its full-attention KV stays): a query at
    # page 8 reads pages 5-7, one at page 7 pages 4-6, so the usable hit ends at page 5.
    evicted.apply(scheduler_pb2.WatchResponse(seq=2, window_removed=hashes[5:7], page_size=PS,
                                              window=WINDOW))
    assert evicted.index == full.index
    assert evicted.matched_pages(hashes, 0.0) == 5
    assert usable_pages([1, 1, 1, 1, 1, -1, -1, 1], PS, WINDOW) == 5  # what the engine says
    router = Router("cache_aware")
    d = router.pick([evicted, full], prompt)
    assert d.view is full and d.predicted_tokens == 8 * PS
    # An engine without a window (or an older one: window 0) scores every cached page.
    plain = EngineView("c:1", up=True)
    plain.apply(scheduler_pb2.WatchResponse(seq=1, snapshot=True, stored=hashes[:8],
                                            page_size=PS))
    assert plain.window == 0 and plain.matched_pages(hashes, 0.0) == 8
    # Evicting a page altogether takes its window KV with it.
    evicted.apply(scheduler_pb2.WatchResponse(seq=3, removed=hashes[7:8], page_size=PS,
                                              window=WINDOW))
    assert hashes[7] not in evicted.win_index and evicted.matched_pages(hashes, 0.0) == 5


def test_routed_prompts_predict_their_window_too() -> None:
    view = EngineView("a:1", up=True, page_size=PS, window=WINDOW)
    hashes = page_hashes(list(range(40)), PS)
    view.note_routed(hashes, now=0.0)
    assert view.matched_pages(hashes, 1.0) == 10
    assert view.matched_pages(hashes, 100.0) == 0  # expired


def test_view_fed_by_the_event_log_scores_what_the_tree_would_use() -> None:
    """A windowed radix tree through inserts, splits, window evictions (LRU) and full
    evictions: a view fed by its event log scores every probe exactly as long as the engine's
    own match, cut to what windowed layers can use."""
    rng = random.Random(3)
    cache = RadixCache(PS, windowed=True, window=WINDOW)
    log = PrefixEventLog(PS)
    cache.listener = log
    sub = log.subscribe(0, cache)
    view = EngineView("a:1", up=True)
    view.apply(scheduler_pb2.WatchResponse(seq=sub.cursor, snapshot=True, stored=sub.snapshot,
                                           window_stored=sub.window_snapshot, page_size=PS,
                                           window=WINDOW))
    bases = [[rng.randrange(50) for _ in range(PS * 8)] for _ in range(3)]
    next_page, cut = 0, 0
    for step in range(300):
        base = bases[rng.randrange(len(bases))]
        tokens = base[: PS * rng.randrange(1, 8)] + [rng.randrange(50) for _ in range(PS * 2)]
        n = len(tokens) // PS
        # Some window pages dropped already (tombstones), as a long request leaves them.
        win = [next_page + i if rng.random() < 0.6 else -1 for i in range(n)]
        node, have = cache.insert(tokens, list(range(next_page, next_page + n)), win=win)
        if have and rng.random() < 0.5:  # a released request filling tombstones
            cache.fill_window(node, 0, have, [next_page + 1000 + i for i in range(n)])
        next_page += n
        if step % 3 == 0:
            cache.evict_window(rng.randrange(1, 6))
        if step % 11 == 0:
            cache.evict(rng.randrange(1, 8), [])
        log.flush()
        _feed(view, log, cache, WINDOW)
        cache.check()
        base = bases[rng.randrange(len(bases))]
        probe = base[: PS * rng.randrange(1, 9)]
        found = cache.match(probe)
        assert found.win is not None
        want = usable_pages(found.win, PS, WINDOW)
        assert view.matched_pages(page_hashes(probe, PS), 0.0) == want, step
        cut += want < found.num_pages
    assert cut > 20  # probes whose full-attention pages alone would over-predict
    # A snapshot now says the same as the events did.
    _, stored, win_hashes = log.snapshot(cache)
    assert set(stored) == view.index and set(win_hashes or []) == view.win_index
