"""KV page bookkeeping per request: the allocator and the radix cache behind one small interface.

A running request's `pages` is its page-table row. The first `shared_pages` entries belong to the
radix tree (kept alive by a lock on `req.node`); the rest are the request's own. Releasing a request
offers its written KV to the cache (whole pages only), frees what the cache did not take, and
drops the lock. With `cache="naive"` there is no tree and every page is private.
"""

from __future__ import annotations

from collections.abc import Iterable

from minisgl_scheduler.pages import PageAllocator
from minisgl_scheduler.radix import READY, MatchResult, RadixCache
from minisgl_scheduler.request import Request


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class KVManager:
    def __init__(self, num_pages: int, page_size: int, use_cache: bool) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(page_size) if use_cache else None
        self.num_pages = num_pages

    # -- capacity ------------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def cached_pages(self) -> int:
        """Pages held only by the prefix cache: evictable on demand."""
        return self.cache.evictable_pages if self.cache else 0

    @property
    def available(self) -> int:
        return self.free_pages + self.cached_pages

    def alloc(self, n: int) -> list[int] | None:
        """n pages, evicting cached prefixes (LRU) when the free list is short; None if impossible."""
        if n > self.available:
            return None
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.allocator.free(self.cache.evict(short))
        return self.allocator.allocate(n)

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Make `req.pages` cover `num_tokens` positions; False (and nothing changed) if no room."""
        need = pages_for(num_tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        got = self.alloc(need)
        if got is None:
            return False
        req.pages.extend(got)
        return True

    # -- prefix cache --------------------------------------------------------------------------

    def match(self, tokens: list[int], ready_before: int, salt: int = 0) -> MatchResult | None:
        if self.cache is None:
            return None
        return self.cache.match(tokens, ready_before, salt)

    def attach(self, req: Request, match: MatchResult | None) -> None:
        """Give `req` the matched prefix pages (locked while it runs)."""
        assert not req.pages and req.node is None
        if match is None or self.cache is None:
            return
        self.cache.lock(match.node)
        req.node = match.node
        req.pages = list(match.pages)
        req.shared_pages = len(match.pages)

    def detach(self, req: Request) -> None:
        """Undo `attach` for a request that was not admitted after all."""
        if req.node is not None and self.cache is not None:
            self.cache.unlock(req.node)
        req.node, req.pages, req.shared_pages = None, [], 0

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
        node, have = cache.insert(tokens, req.pages[:n], ready_step=step_id, salt=req.salt)
        assert have == req.shared_pages
        cache.lock(node)
        if req.node is not None:
            cache.unlock(req.node)
        req.node, req.shared_pages = node, n

    def release(self, req: Request, offer: bool) -> None:
        """Return every page `req` holds: to the cache (whole written pages) or the free list."""
        ps, cache = self.page_size, self.cache
        to_free = req.pages[req.shared_pages :]
        if cache is not None and offer:
            n = min(req.computed, len(req.tokens)) // ps
            if n > req.shared_pages:
                _, have = cache.insert(req.tokens[: n * ps], req.pages[:n], READY, req.salt)
                assert have >= req.shared_pages
                # [shared, have): the tree got the same prefix from someone else; ours are spare.
                to_free = req.pages[req.shared_pages : have] + req.pages[n:]
        if req.node is not None and cache is not None:
            cache.unlock(req.node)
        self.allocator.free(to_free)
        req.node, req.pages, req.shared_pages, req.sent_pages = None, [], 0, 0

    def drop_cache(self) -> None:
        """Forget every unreferenced cached prefix (after a worker failure made KV suspect)."""
        if self.cache is not None:
            self.allocator.free(self.cache.evict_all())

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
            for r in holders:
                node = r.node
                while node is not None and node is not self.cache.root:
                    expected[id(node)] = expected.get(id(node), 0) + 1
                    node = node.parent
                if r.node is not None:
                    path = self._path_pages(r)
                    assert path == r.pages[: r.shared_pages], "shared pages differ from the tree"
            for node in self.cache._nodes():
                assert node.ref == expected.get(id(node), 0), "ref count != locks held"
        everything = free + private + tree
        assert len(everything) == self.num_pages, (
            f"free {len(free)} + private {len(private)} + cached {len(tree)} "
            f"!= pool {self.num_pages}"
        )
        assert len(set(everything)) == self.num_pages, "a page is in two places"

    def _path_pages(self, req: Request) -> list[int]:
        assert self.cache is not None
        chunks, node = [], req.node
        while node is not None and node is not self.cache.root:
            chunks.append(node.pages)
            node = node.parent
        return [p for chunk in reversed(chunks) for p in chunk]
