"""KV page bookkeeping per request: the allocator and the radix cache behind one small interface.

A running request's `pages` is its page-table row. The first `shared_pages` entries belong to the
radix tree (kept alive by a lock on `req.node`); the rest are the request's own. Releasing a request
offers its written KV to the cache (whole pages only), frees what the cache did not take, and
drops the lock. With `cache="naive"` there is no tree and every page is private.

Window pool (`window_pages` > 0: the worker keeps its sliding-window layers' KV in a second pool):
`req.win` is a second row aligned with `req.pages`, one window page per logical page, -1 once
dropped. Both rows grow together; `trim` drops the window pages no future query of the request can
see (through `DeferredFree`, since launched steps may still read them); the radix tree keeps
window pages next to full ones and a prefix hit is cut to what windowed layers can use
(docs/architecture.md, "Sliding-window layers"). A request window-locks the tree nodes of its
path from page `req.win_from` = min(win_lo, shared_pages) on; as its window moves on, the tree
pages it passes stay in the tree as evictable cache (the lock moves to a `_WinHold` until the
launched steps that may still read them are collected).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from minisgl_scheduler.kv_window import DeferredFree, first_visible_page, usable_pages
from minisgl_scheduler.pages import PageAllocator
from minisgl_scheduler.radix import READY, MatchResult, Node, RadixCache
from minisgl_scheduler.request import Request


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class _WinHold(NamedTuple):
    """Tree window pages a request no longer reads but launched steps up to `until_step` may:
    the path to `node` (locked) and its window pages from page `start` on (window-locked)."""

    until_step: int
    node: Node
    start: int


class KVManager:
    def __init__(self, num_pages: int, page_size: int, use_cache: bool, window_pages: int = 0,
                 window: int = 0) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.num_pages = num_pages
        self.win_alloc = PageAllocator(window_pages) if window_pages else None
        self.window = window if window_pages else 0
        self.window_pages = window_pages
        self.deferred = DeferredFree()  # dropped window pages that launched steps may still read
        self.win_holds: deque[_WinHold] = deque()  # the same for tree window pages (kept cached)
        self.cache = (RadixCache(page_size, windowed=self.windowed, window=self.window)
                      if use_cache else None)

    @property
    def windowed(self) -> bool:
        return self.win_alloc is not None

    # -- capacity ------------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def cached_pages(self) -> int:
        """Pages held only by the prefix cache: evictable on demand."""
        return self.cache.evictable_pages if self.cache else 0

    @property
    def win_available(self) -> int:
        """Window pages free or held only by the cache (evictable); 0 without a window pool."""
        if self.win_alloc is None:
            return 0
        return self.win_alloc.num_free + (self.cache.evictable_win if self.cache else 0)

    @property
    def available(self) -> int:
        """Logical pages a request can still get: each takes a full page and, with a window
        pool, a window page."""
        full = self.free_pages + self.cached_pages
        return full if self.win_alloc is None else min(full, self.win_available)

    def fits(self, need: int, reserve: int, reserve_win: int) -> bool:
        """`need` new logical pages with `reserve` full (`reserve_win` window) pages kept back."""
        if need + reserve > self.free_pages + self.cached_pages:
            return False
        return self.win_alloc is None or need + reserve_win <= self.win_available

    def alloc(self, n: int) -> list[int] | None:
        """n pages, evicting cached prefixes (LRU) when the free list is short; None if impossible.
        (No window pool only: `grow` takes both kinds.)"""
        assert self.win_alloc is None, "with a window pool, pages come through grow()"
        got = self._alloc(n)
        return got[0] if got is not None else None

    def _alloc(self, n: int) -> tuple[list[int], list[int]] | None:
        if n > self.available:
            return None
        short = n - self.allocator.num_free
        dropped: list[int] = []
        if short > 0 and self.cache is not None:
            self.allocator.free(self.cache.evict(short, dropped))
        if self.win_alloc is None:
            return self.allocator.allocate(n), []
        self.win_alloc.free(dropped)
        short = n - self.win_alloc.num_free
        if short > 0 and self.cache is not None:
            self.win_alloc.free(self.cache.evict_window(short))
        return self.allocator.allocate(n), self.win_alloc.allocate(n)

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Make `req.pages` cover `num_tokens` positions; False (and nothing changed) if no room."""
        need = pages_for(num_tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        got = self._alloc(need)
        if got is None:
            return False
        req.pages.extend(got[0])
        req.win.extend(got[1])
        return True

    # -- sliding windows -----------------------------------------------------------------------

    def trim(self, req: Request, pos: int, until_step: int | None) -> None:
        """Drop the window pages that no query at position >= `pos` can read: the request's own
        ones go back (after launched steps up to `until_step` are collected; None: nothing in
        flight, now), the tree's stay cached there, evictable once those steps are collected."""
        # Kept from the page boundary at or below `pos`: the request's KV stays usable as a
        # cached prefix that ends there (the next turn of a conversation), one page more at most.
        ps = self.page_size
        lo = min(first_visible_page(pos // ps * ps, self.window, ps), len(req.win))
        if lo <= req.win_lo:
            return
        out: list[int] = []
        win = req.win
        for i in range(req.win_lo, lo):
            if win[i] >= 0 and i >= req.shared_pages:
                out.append(win[i])
            win[i] = -1  # below shared_pages: the tree's copy, which may now be evicted
        req.win_lo = lo
        if until_step is None:
            self._free_win(out)
        else:
            self.deferred.put(out, until_step)
        self._move_win_lock(req, until_step)

    def _move_win_lock(self, req: Request, until_step: int | None) -> None:
        """Advance `req.win_from` to min(win_lo, shared_pages): the tree nodes passed are no
        longer read by `req` (but maybe by launched steps up to `until_step`)."""
        to = min(req.win_lo, req.shared_pages)
        if to <= req.win_from or self.cache is None or req.node is None:
            return
        end = self.cache.boundary(req.node, to)
        if until_step is None:
            self.cache.win_unlock(end, req.win_from)
        else:  # the lock passes to a hold (with a path lock: the nodes must stay)
            self.cache.lock(end)
            self.win_holds.append(_WinHold(until_step, end, req.win_from))
        req.win_from = to

    def _release_holds(self, step_id: int | None) -> None:
        """Holds whose steps are collected (steps are collected in launch order); None: all."""
        cache = self.cache
        while self.win_holds and (step_id is None or self.win_holds[0].until_step <= step_id):
            hold = self.win_holds.popleft()
            assert cache is not None
            cache.win_unlock(hold.node, hold.start)
            cache.unlock(hold.node)

    def collected(self, step_id: int) -> None:
        """Step `step_id` was collected (or failed): window pages it could read are free."""
        if self.deferred:
            self._free_win(self.deferred.take(step_id))
        self._release_holds(step_id)

    def _free_win(self, pages: list[int]) -> None:
        if pages:
            assert self.win_alloc is not None
            self.win_alloc.free(pages)

    # -- prefix cache --------------------------------------------------------------------------

    def match(self, tokens: list[int], ready_before: int, salt: int = 0) -> MatchResult | None:
        """The cached prefix a request can start from; with a window pool, cut to the longest
        one whose windowed-layer KV is kept for the first query after it."""
        if self.cache is None:
            return None
        found = self.cache.match(tokens, ready_before, salt)
        if self.win_alloc is not None and found.win is not None:
            found = self.cache.cut(found, usable_pages(found.win, self.page_size, self.window))
        return found

    def attach(self, req: Request, match: MatchResult | None) -> None:
        """Give `req` the matched prefix pages (locked while it runs)."""
        assert not req.pages and req.node is None
        if match is None or self.cache is None:
            return
        self.cache.lock(match.node)
        req.node = match.node
        req.pages = list(match.pages)
        req.shared_pages = len(match.pages)
        if self.win_alloc is not None and match.win is not None:
            lo = first_visible_page(len(req.pages) * self.page_size, self.window, self.page_size)
            # Pages before the first query's window are not read: left to the cache (-1 here).
            req.win = [-1] * lo + list(match.win[lo:])
            req.win_lo = req.win_from = lo
            if lo < req.shared_pages:
                if lo > 0:  # a window lock starts at a node boundary
                    self.cache.boundary(match.node, lo)
                self.cache.win_lock(match.node, lo)

    def detach(self, req: Request) -> None:
        """Undo `attach` for a request that was not admitted after all."""
        if req.node is not None and self.cache is not None:
            self._unlock(req)
        req.node, req.pages, req.shared_pages = None, [], 0
        req.win, req.win_lo, req.win_from = [], 0, 0

    def _unlock(self, req: Request) -> None:
        assert self.cache is not None and req.node is not None
        if self.windowed:
            self.cache.win_unlock(req.node, req.win_from)
        self.cache.unlock(req.node)

    def cache_prefix(self, req: Request, num_tokens: int, step_id: int) -> None:
        """Share the first `num_tokens` of a running request (written by step `step_id`).

        Skipped when the tree already holds more of this prefix than the request shares: the
        request then keeps computing on its own copies, which are offered again on release.
        """
        cache = self.cache
        n = num_tokens // self.page_size
        if cache is None or n <= req.shared_pages:
            return
        tokens = req.tokens[: n * self.page_size]
        if cache.match(tokens, salt=req.salt).num_pages != req.shared_pages:
            return
        node, have = cache.insert(tokens, req.pages[:n], ready_step=step_id, salt=req.salt,
                                  win=req.win[:n] if self.windowed else None)
        assert have == req.shared_pages
        cache.lock(node)
        if self.windowed:  # the new nodes join the request's window lock
            if req.win_from < have:
                cache.win_lock(node, have)
            else:  # nothing locked yet: from the first page its window still reads
                req.win_from = min(req.win_lo, n)
                if req.win_from > have:
                    cache.boundary(node, req.win_from)
                if req.win_from < n:
                    cache.win_lock(node, req.win_from)
        if req.node is not None:
            cache.unlock(req.node)
        req.node, req.shared_pages = node, n

    def release(self, req: Request, offer: bool) -> None:
        """Return every page `req` holds: to the cache (whole written pages) or the free list."""
        ps, cache, shared = self.page_size, self.cache, req.shared_pages
        to_free = req.pages[shared:]
        win_free = [p for p in req.win[shared:] if p >= 0]
        if cache is not None and offer:
            n = min(req.computed, len(req.tokens)) // ps
            if n > shared:
                win = req.win[:n] if self.windowed else None
                node, have = cache.insert(req.tokens[: n * ps], req.pages[:n], READY, req.salt,
                                          win)
                assert have >= shared
                # [shared, have): the tree got the same prefix from someone else; ours are spare.
                to_free = req.pages[shared:have] + req.pages[n:]
                if self.windowed:
                    spare = cache.fill_window(node, shared, have, req.win)
                    win_free = spare + [p for p in req.win[n:] if p >= 0]
        if req.node is not None and cache is not None:
            self._unlock(req)
        self.allocator.free(to_free)
        self._free_win(win_free)
        req.node, req.pages, req.shared_pages, req.sent_pages = None, [], 0, 0
        req.win, req.win_lo, req.win_from = [], 0, 0

    def drop_cache(self) -> None:
        """Forget every unreferenced cached prefix (after a worker failure made KV suspect)."""
        if self.cache is not None:
            dropped: list[int] = []
            self.allocator.free(self.cache.evict_all(dropped))
            self._free_win(dropped)

    def drain_deferred(self) -> None:
        """Nothing is in flight any more: every deferred window page is free."""
        self._free_win(self.deferred.take_all())
        self._release_holds(None)

    # -- invariants ----------------------------------------------------------------------------

    def check(self, holders: Iterable[Request]) -> None:
        """Every page in exactly one place; ref counts equal the locks requests hold."""
        holders = list(holders)
        free = [p for p in range(self.num_pages) if self.allocator.is_free(p)]
        assert len(free) == self.allocator.num_free, "free list and free map disagree"
        private = [p for r in holders for p in r.pages[r.shared_pages :]]
        tree: list[int] = []
        if self.cache is not None:
            self.cache.check()
            tree = self.cache.all_pages()
            expected: dict[int, int] = {}
            expected_win: dict[int, int] = {}
            locks = [(r.node, r.win_from) for r in holders if r.node is not None]
            locks += [(h.node, h.start) for h in self.win_holds]
            for end, win_from in locks:
                at = self.cache.depth(end)
                node = end
                while node is not self.cache.root:
                    expected[id(node)] = expected.get(id(node), 0) + 1
                    at -= len(node.pages)
                    if self.windowed and at >= win_from:
                        expected_win[id(node)] = expected_win.get(id(node), 0) + 1
                    elif self.windowed:
                        assert at + len(node.pages) <= win_from, "window lock inside a node"
                    node = node.parent  # type: ignore[assignment]  # None only past the root
            for r in holders:
                if r.node is not None:
                    path = self._path_pages(r)
                    assert path == r.pages[: r.shared_pages], "shared pages differ from the tree"
            for node in self.cache._nodes():
                assert node.ref == expected.get(id(node), 0), "ref count != locks held"
                assert node.win_ref == expected_win.get(id(node), 0), "window locks != held"
        everything = free + private + tree
        assert len(everything) == self.num_pages, (
            f"free {len(free)} + private {len(private)} + cached {len(tree)} "
            f"!= pool {self.num_pages}"
        )
        assert len(set(everything)) == self.num_pages, "a page is in two places"
        if self.win_alloc is not None:
            self._check_window(holders)

    def _check_window(self, holders: list[Request]) -> None:
        """Every window page in exactly one place (free, deferred, a request's own, the tree);
        each request keeps every window page a future query of its can read."""
        assert self.win_alloc is not None
        n = self.window_pages
        free = [p for p in range(n) if self.win_alloc.is_free(p)]
        assert len(free) == self.win_alloc.num_free, "window free list and free map disagree"
        private: list[int] = []
        for r in holders:
            assert len(r.win) == len(r.pages), "window row misaligned with the page row"
            tree = self._path_win(r) if r.node is not None else []
            for i, p in enumerate(r.win):
                if i >= r.win_lo:
                    assert p >= 0, "a window page a future query reads was dropped"
                if i < r.shared_pages:  # the tree's: a copy, or -1 (left to the cache) below win_lo
                    ok = p == -1 if i < r.win_lo else p == tree[i]
                    assert ok, "shared window page differs from the tree"
                elif p >= 0:
                    assert i >= r.win_lo, "a dropped window page is still held"
                    private.append(p)
            ps = self.page_size
            lo = first_visible_page(r.computed // ps * ps, self.window, ps)
            assert r.win_lo <= lo, "window pages dropped that the next query reads"
            assert r.win_from == min(r.win_lo, r.shared_pages), "window lock not at win_lo"
        tree_pages = self.cache.all_win_pages() if self.cache is not None else []
        everything = free + self.deferred.pages() + private + tree_pages
        assert len(everything) == n, (
            f"window pool: free {len(free)} + deferred {len(self.deferred)} + private "
            f"{len(private)} + cached {len(tree_pages)} != {n}")
        assert len(set(everything)) == n, "a window page is in two places"

    def _path_win(self, req: Request) -> list[int]:
        assert self.cache is not None and req.node is not None
        return [p for node in self.cache.path(req.node) for p in node.win]

    def _path_pages(self, req: Request) -> list[int]:
        assert self.cache is not None
        chunks, node = [], req.node
        while node is not None and node is not self.cache.root:
            chunks.append(node.pages)
            node = node.parent
        return [p for chunk in reversed(chunks) for p in chunk]
