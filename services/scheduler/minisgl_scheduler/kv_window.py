"""Sliding-window KV: which logical pages a windowed layer can still read, and when a dropped
window page may be reused.

A worker with a window pool keeps the KV of its sliding-window layers in a second pool; a request
holds, next to its page row `pages`, a row `win` of window-pool pages (-1 where none is kept). The
rules here are pure arithmetic over positions, shared by the KV manager and the tests:

* A query at position p reads keys p - window + 1 .. p. A request whose next entry starts at
  position `pos` never again reads a page that ends before pos - window + 1: every later query
  sits at pos or after. `first_visible_page` is the first page it may still read. The KV manager
  keeps from the page boundary at or below `pos` instead, so that the request's KV stays usable
  as a cached prefix ending at that boundary (one page more, at most).
* A cached prefix of h pages is usable for windowed layers only if the window pages of the last
  `window - 1` positions before h * page_size are all kept (the first computed query reads them):
  `usable_pages`.
* A window page dropped while planning step S may still be read by the launched steps before S
  (overlap scheduling), so it waits in `DeferredFree` until the last of those is collected.
"""

from __future__ import annotations

from collections import deque


def first_visible_page(pos: int, window: int, page_size: int) -> int:
    """The first logical page a query at position >= `pos` can read under `window`."""
    return max(0, (pos - window + 1) // page_size)


def usable_pages(win: list[int], page_size: int, window: int) -> int:
    """The longest prefix (in pages) of a cached row `win` from which windowed layers can carry
    on: every page a query at h * page_size reads is kept (>= 0)."""
    run = 0  # kept pages ending at the current end
    best = 0
    for h in range(1, len(win) + 1):
        run = run + 1 if win[h - 1] >= 0 else 0
        if run >= h - first_visible_page(h * page_size, window, page_size):
            best = h
    return best


class DeferredFree:
    """Window pages dropped during planning, each batch held until a given step is collected."""

    def __init__(self) -> None:
        self._held: deque[tuple[int, list[int]]] = deque()

    def put(self, pages: list[int], until_step: int) -> None:
        if pages:
            self._held.append((until_step, pages))

    def take(self, collected_step: int) -> list[int]:
        """Pages whose step has been collected (steps are collected in launch order)."""
        out: list[int] = []
        while self._held and self._held[0][0] <= collected_step:
            out.extend(self._held.popleft()[1])
        return out

    def take_all(self) -> list[int]:
        out = [p for _, pages in self._held for p in pages]
        self._held.clear()
        return out

    def pages(self) -> list[int]:
        return [p for _, pages in self._held for p in pages]

    def __len__(self) -> int:
        return sum(len(pages) for _, pages in self._held)
