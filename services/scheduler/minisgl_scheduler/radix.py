"""Radix prefix cache at page granularity: token prefixes -> the KV pages that hold them.

Only whole pages are shared: a node holds `k * page_size` tokens and their `k` pages, and edges are
keyed by the tokens of a child's first page. A node's `ref` counts the running requests whose matched
prefix passes through it; pages of nodes with `ref == 0` are evictable, least recently used leaves
first. The tree never frees pages itself: `evict` hands them back to the caller's allocator.

`ready_step` handles prefixes inserted while their KV is still being computed: pages inserted for
step S are written when step S runs, so only steps after S may read them. `match(ready_before=S)`
stops at such a node and says so (`blocked`), letting the scheduler wait one step instead of
computing the same prefix twice.

Cache salts (a request's `cache_salt`, as `minisgl_core.prefix_hash.salt_seed`) split the tree into
namespaces: every node carries the salt of the requests that made it, and a salted request's edge
keys include its salt, so a lookup under one salt never reaches a page cached under another. Salt 0
(no salt) keys edges by tokens alone, as before.

Window pool (`windowed=True`, a worker whose sliding-window layers keep KV in a second pool): each
node also holds `win`, aligned with `pages`, the window-pool page of each logical page or -1 where
it is gone (a "tombstone": the full-attention KV is cached, the windowed layers' is not). A second
count, `win_ref`, says how many holders still *read* a node's window pages (a running request
whose window reaches into the node; `win_lock(node, start)` takes the nodes of a path from page
`start` on). Window pages of nodes with `win_ref == 0` are evictable on their own
(`evict_window`, LRU) without removing the node, even while `ref` keeps the node's full pages:
a request's window moves past a shared prefix and leaves that prefix's window pages as cache.
Whether a prefix with tombstones is usable is the caller's question (kv_window.usable_pages).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Protocol

READY = -1  # ready_step of pages whose KV is already written


class CacheListener(Protocol):
    """Told of every page that enters or leaves the tree (prefix_events.PrefixEventLog)."""

    def stored(self, tokens: list[int], first_new_page: int, salt: int = 0) -> None: ...

    def removed(self, path_tokens: list[int], first_removed_page: int, salt: int = 0) -> None: ...

    def window(self, path_tokens: list[int], pages: list[int], kept: bool, salt: int = 0) -> None:
        """Windowed trees: the window-pool KV of these pages (indices into `path_tokens`' pages)
        is now cached (`kept`) or gone; their full-attention KV is unchanged."""
        ...


class Node:
    __slots__ = ("tokens", "pages", "children", "parent", "ref", "last_access", "ready_step",
                 "salt", "win", "win_ref")

    def __init__(self, tokens: list[int], pages: list[int], parent: Node | None,
                 ready_step: int = READY, salt: int = 0, win: list[int] | None = None) -> None:
        self.tokens = tokens
        self.pages = pages
        self.win = win if win is not None else []  # window pool only: aligned with pages
        self.win_ref = 0  # holders that still read `win` (always <= ref)
        self.children: dict[object, Node] = {}
        self.parent = parent
        self.ref = 0
        self.last_access = 0
        self.ready_step = ready_step
        self.salt = salt  # the cache namespace: part of the edge key into this node

    def __lt__(self, other: Node) -> bool:  # heap order for LRU eviction
        return self.last_access < other.last_access


@dataclass(slots=True)
class MatchResult:
    node: Node  # deepest matched node (the root when nothing matched)
    pages: list[int]  # pages of the matched prefix, in order
    blocked: bool = False  # a longer match exists but its KV is not written before `ready_before`
    win: list[int] | None = None  # window pool only: aligned with pages (-1: tombstone)

    @property
    def num_pages(self) -> int:
        return len(self.pages)


def present(win: list[int]) -> int:
    """Window pages a node still holds (not tombstoned)."""
    return len(win) - win.count(-1)


class RadixCache:
    def __init__(self, page_size: int, windowed: bool = False, window: int = 0) -> None:
        self.page_size = page_size
        self.windowed = windowed
        self.window = window if windowed else 0  # tokens a windowed layer reads (for listeners)
        self.evictable_win = 0  # window pages of nodes no holder reads (win_ref == 0)
        self.root = Node([], [], None)
        self.root.ref = 1  # never evicted
        self.total_pages = 0  # pages owned by the tree
        self.evictable_pages = 0  # of those, held by no running request
        self._clock = 0
        self.listener: CacheListener | None = None

    # -- lookup -------------------------------------------------------------------------------

    def _key(self, tokens: list[int], offset: int, salt: int) -> object:
        page: object = (tokens[offset] if self.page_size == 1
                        else tuple(tokens[offset : offset + self.page_size]))
        # A (salt, page) pair never equals an unsalted key (an int or a tuple of ints).
        return (salt, page) if salt else page

    def _common_pages(self, node: Node, tokens: list[int], offset: int) -> int:
        """Whole pages that `node` shares with `tokens[offset:]` (the first page is known equal)."""
        ps = self.page_size
        n = min(len(node.pages), (len(tokens) - offset) // ps)
        if node.tokens[: n * ps] == tokens[offset : offset + n * ps]:
            return n
        k = 1
        while k < n and node.tokens[k * ps : (k + 1) * ps] == tokens[offset + k * ps :
                                                                     offset + (k + 1) * ps]:
            k += 1
        return k

    def _split(self, node: Node, k: int) -> Node:
        """Cut `node` after its first k pages; returns the new upper node (same ref, same tag)."""
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < k < len(node.pages)
        upper = Node(node.tokens[: k * ps], node.pages[:k], parent, node.ready_step, node.salt,
                     node.win[:k])
        node.win = node.win[k:]
        upper.ref = node.ref
        # Window locks start at node boundaries, so whoever locks `node` locks both halves.
        upper.win_ref = node.win_ref
        upper.last_access = node.last_access
        parent.children[self._key(node.tokens, 0, node.salt)] = upper
        node.tokens = node.tokens[k * ps :]
        node.pages = node.pages[k:]
        node.parent = upper
        upper.children[self._key(node.tokens, 0, node.salt)] = node
        return upper

    def match(self, tokens: list[int], ready_before: int | None = None,
              salt: int = 0) -> MatchResult:
        """Longest prefix of `tokens` cached under `salt`, in whole pages (nodes split at the
        match end)."""
        self._clock += 1
        node, offset, pages = self.root, 0, list[int]()
        win: list[int] | None = [] if self.windowed else None
        ps = self.page_size
        while len(tokens) - offset >= ps:
            child = node.children.get(self._key(tokens, offset, salt))
            if child is None:
                break
            if ready_before is not None and child.ready_step >= ready_before:
                return MatchResult(node, pages, blocked=True, win=win)
            k = self._common_pages(child, tokens, offset)
            if k < len(child.pages):
                child = self._split(child, k)
            child.last_access = self._clock
            pages.extend(child.pages)
            if win is not None:
                win.extend(child.win)
            offset += k * ps
            node = child
        return MatchResult(node, pages, win=win)

    def cut(self, found: MatchResult, n: int) -> MatchResult:
        """`found` shortened to its first n pages (the node ending there split off if needed)."""
        if n >= found.num_pages:
            return found
        if n <= 0:
            return MatchResult(self.root, [], found.blocked, [] if found.win is not None else None)
        return MatchResult(self.boundary(found.node, n), found.pages[:n], found.blocked,
                           found.win[:n] if found.win is not None else None)

    def path(self, node: Node) -> list[Node]:
        """The nodes from below the root down to `node`."""
        out = []
        while node is not self.root:
            out.append(node)
            node = node.parent  # type: ignore[assignment]  # None only past the root
        out.reverse()
        return out

    # -- ownership ------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.ref == 0:
                self.evictable_pages -= len(node.pages)
            node.ref += 1
            node = node.parent  # type: ignore[assignment]  # None only past the root

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            if node.ref <= 0:
                raise RuntimeError("radix node unlocked more often than locked")
            node.ref -= 1
            if node.ref == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent  # type: ignore[assignment]  # None only past the root

    def win_lock(self, node: Node, start: int) -> None:
        """Lock the window pages of the nodes on the path to `node` that start at page `start`
        or later (`start` must be a node boundary of that path: see `boundary`)."""
        self._win_ref(node, start, 1)

    def win_unlock(self, node: Node, start: int) -> None:
        self._win_ref(node, start, -1)

    def _win_ref(self, node: Node, start: int, delta: int) -> None:
        at = self.depth(node)
        while node is not self.root:
            at -= len(node.pages)  # where `node` starts
            if at < start:
                assert at + len(node.pages) <= start, "window lock not at a node boundary"
                break
            if delta > 0 and node.win_ref == 0:
                self.evictable_win -= present(node.win)
            node.win_ref += delta
            if node.win_ref < 0 or node.win_ref > node.ref:
                raise RuntimeError("radix node window-locked outside its path locks")
            if delta < 0 and node.win_ref == 0:
                self.evictable_win += present(node.win)
            node = node.parent  # type: ignore[assignment]  # None only past the root

    def depth(self, node: Node) -> int:
        """Pages from the root to the end of `node`."""
        n = 0
        while node is not self.root:
            n += len(node.pages)
            node = node.parent  # type: ignore[assignment]  # None only past the root
        return n

    def boundary(self, node: Node, page: int) -> Node:
        """The node on the path to `node` that ends at page `page` (0 < page <= depth), split
        off if `page` falls inside one."""
        end = self.depth(node)
        assert 0 < page <= end
        while end - len(node.pages) >= page:
            end -= len(node.pages)
            node = node.parent  # type: ignore[assignment]  # page > 0: stops above the root
        if end > page:
            node = self._split(node, len(node.pages) - (end - page))
        return node

    def insert(self, tokens: list[int], pages: list[int], ready_step: int = READY,
               salt: int = 0, win: list[int] | None = None) -> tuple[Node, int]:
        """Cache `pages` (one per page of `tokens`, whole pages only) under `salt`.

        Returns the node that ends the prefix and how many leading pages the tree already had:
        the caller's pages from that index on now belong to the tree; the caller's pages before it
        are either the tree's own (a prefix it matched earlier) or duplicates the caller still owns.
        A windowed tree takes `win` (aligned with `pages`) along with the new pages.
        """
        ps = self.page_size
        if len(tokens) != len(pages) * ps:
            raise ValueError("insert takes whole pages: len(tokens) == len(pages) * page_size")
        if self.windowed != (win is not None) or (win is not None and len(win) != len(pages)):
            raise ValueError("a windowed tree takes window pages aligned with pages, no other")
        found = self.match(tokens, salt=salt)
        have = found.num_pages
        node = found.node
        if have < len(pages):
            new = Node(tokens[have * ps :], pages[have:], node, ready_step, salt,
                       win[have:] if win is not None else None)
            new.last_access = self._clock
            node.children[self._key(new.tokens, 0, salt)] = new
            self.total_pages += len(new.pages)
            self.evictable_pages += len(new.pages)
            self.evictable_win += present(new.win)
            node = new
            if self.listener is not None:
                self.listener.stored(tokens, have, salt)
                kept = [have + j for j, p in enumerate(new.win) if p >= 0]
                if kept:
                    self.listener.window(tokens, kept, True, salt)
        return node, have

    def evict(self, n: int, win_out: list[int] | None = None) -> list[int]:
        """Free up to n unreferenced pages, least recently used leaves first (tails of nodes).
        A windowed tree appends the window pages of the removed pages to `win_out`."""
        if n <= 0 or self.evictable_pages == 0:
            return []
        heap = [x for x in self._nodes() if not x.children and x.ref == 0]
        heapq.heapify(heap)
        out: list[int] = []
        while heap and len(out) < n:
            node = heapq.heappop(heap)
            take = min(len(node.pages), n - len(out))
            if self.listener is not None:
                self._tell_removed(self.listener, node, len(node.pages) - take)
            if take < len(node.pages):  # trim the tail, keep the head cached
                out.extend(node.pages[-take:])
                node.pages = node.pages[:-take]
                node.tokens = node.tokens[: len(node.pages) * self.page_size]
                if node.win:
                    self._drop_win(node.win[-take:], win_out)
                    node.win = node.win[:-take]
                break
            out.extend(node.pages)
            if node.win:
                self._drop_win(node.win, win_out)
            parent = node.parent
            assert parent is not None
            del parent.children[self._key(node.tokens, 0, node.salt)]
            node.parent = None
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, parent)
        self.total_pages -= len(out)
        self.evictable_pages -= len(out)
        return out

    def _drop_win(self, win: list[int], out: list[int] | None) -> None:
        kept = [p for p in win if p >= 0]
        self.evictable_win -= len(kept)  # only unlocked nodes are evicted (win_ref <= ref)
        if out is None:
            raise ValueError("evicting a windowed tree needs win_out for its window pages")
        out.extend(kept)

    def evict_window(self, n: int) -> list[int]:
        """Tombstone up to n window pages of nodes nobody reads them from (`win_ref == 0`), least
        recently used first; the nodes (full-attention KV) stay. Returns the window pages.

        A match touches every node of its path at once, so ties are common: the shallower node
        goes first, and a node's pages from its front, since a hit needs the window pages just
        before its end, never the ones before those (a long prefix stays usable)."""
        if n <= 0 or self.evictable_win == 0:
            return []
        heap: list[tuple[int, int, int, Node]] = []
        stack = [(x, len(x.pages)) for x in self.root.children.values()]
        while stack:
            node, end = stack.pop()
            if node.win_ref == 0 and present(node.win):
                heap.append((node.last_access, end, len(heap), node))
            stack.extend((x, end + len(x.pages)) for x in node.children.values())
        heapq.heapify(heap)
        out: list[int] = []
        while heap and len(out) < n:
            node = heapq.heappop(heap)[3]
            gone = []
            for i, p in enumerate(node.win):
                if p >= 0 and len(out) < n:
                    out.append(p)
                    node.win[i] = -1
                    gone.append(i)
            if self.listener is not None:
                path = self._path_tokens(node)
                first = len(path) // self.page_size - len(node.pages)
                self.listener.window(path, [first + i for i in gone], False, node.salt)
        self.evictable_win -= len(out)
        return out

    def fill_window(self, node: Node, start: int, end: int, win: list[int]) -> list[int]:
        """Window pages `win` (aligned with the path's pages from the root) of logical pages
        [start, end) of the path to `node`, which the tree holds already: each fills a tombstone
        (the same tokens' KV) or is spare; returns the spare ones."""
        spare: list[int] = []
        at = 0
        for x in self.path(node):
            filled = []
            for j in range(max(start - at, 0), min(end - at, len(x.pages))):
                p = win[at + j]
                if p < 0:
                    continue
                if x.win[j] < 0:
                    x.win[j] = p
                    filled.append(at + j)
                    if x.win_ref == 0:
                        self.evictable_win += 1
                else:
                    spare.append(p)
            at += len(x.pages)
            if filled and self.listener is not None:
                self.listener.window(self._path_tokens(x), filled, True, x.salt)
        return spare

    def _tell_removed(self, listener: CacheListener, node: Node, keep: int) -> None:
        path = self._path_tokens(node)
        first = len(path) // self.page_size - (len(node.pages) - keep)
        listener.removed(path, first, node.salt)
        if self.windowed:  # both kinds of KV go: the window pages' absence is news as well
            kept = [first + j for j in range(keep, len(node.pages)) if node.win[j] >= 0]
            if kept:
                listener.window(path, kept, False, node.salt)

    def _path_tokens(self, node: Node) -> list[int]:
        chunks: list[list[int]] = []
        up: Node | None = node
        while up is not None and up is not self.root:
            chunks.append(up.tokens)
            up = up.parent
        return [t for chunk in reversed(chunks) for t in chunk]

    def evict_all(self, win_out: list[int] | None = None) -> list[int]:
        return self.evict(self.evictable_pages, win_out)

    # -- inspection -----------------------------------------------------------------------------

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_pages(self) -> list[int]:
        return [p for node in self._nodes() for p in node.pages]

    def all_win_pages(self) -> list[int]:
        return [p for node in self._nodes() for p in node.win if p >= 0]

    def check(self) -> None:
        """Structural invariants; raises AssertionError on the first broken one (tests, debug)."""
        total = evictable = evictable_win = 0
        for node in self._nodes():
            assert node.pages, "empty node"
            assert len(node.win) == (len(node.pages) if self.windowed else 0), "win misaligned"
            evictable_win += present(node.win) if node.win_ref == 0 else 0
            assert 0 <= node.win_ref <= node.ref, "window lock outside the path locks"
            assert len(node.tokens) == len(node.pages) * self.page_size, "tokens/pages mismatch"
            assert node.ref >= 0, "negative ref count"
            parent = node.parent
            assert parent is not None
            assert parent.children.get(self._key(node.tokens, 0, node.salt)) is node
            assert parent is self.root or parent.salt == node.salt, "salts mixed on a path"
            assert parent is self.root or parent.ref >= node.ref, "child locked without parent"
            total += len(node.pages)
            evictable += len(node.pages) if node.ref == 0 else 0
        assert total == self.total_pages, (total, self.total_pages)
        assert evictable == self.evictable_pages, (evictable, self.evictable_pages)
        assert evictable_win == self.evictable_win, (evictable_win, self.evictable_win)
