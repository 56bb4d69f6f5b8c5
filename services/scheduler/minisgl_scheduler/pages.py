"""The free list of KV pages. Page ids index the worker's KV pool; the scheduler decides who owns what.

A page is, at any time, in exactly one place: this free list, a request's private pages, or a radix
tree node (locked by running requests or evictable). Double frees and foreign ids fail loudly here:
they are bugs, and a silent one would hand one page to two requests.
"""

from __future__ import annotations


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        # A stack: recently freed pages are reused first (their memory is likely warm).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} pages, {len(self._free)} free")
        if n <= 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page {p} is not in the pool of {self.num_pages}")
            if self._is_free[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._is_free[p] = True
        self._free.extend(pages)

    def is_free(self, page: int) -> bool:
        return self._is_free[page]
