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


class Node:
    __slots__ = ("tokens", "pages", "children", "parent", "ref", "last_access", "ready_step",
                 "salt")

    def __init__(self, tokens: list[int], pages: list[int], parent: Node | None,
                 ready_step: int = READY, salt: int = 0) -> None:
        self.tokens = tokens
        self.pages = pages
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

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class RadixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
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
        upper = Node(node.tokens[: k * ps], node.pages[:k], parent, node.ready_step, node.salt)
        upper.ref = node.ref
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
        ps = self.page_size
        while len(tokens) - offset >= ps:
            child = node.children.get(self._key(tokens, offset, salt))
            if child is None:
                break
            if ready_before is not None and child.ready_step >= ready_before:
                return MatchResult(node, pages, blocked=True)
            k = self._common_pages(child, tokens, offset)
            if k < len(child.pages):
                child = self._split(child, k)
            child.last_access = self._clock
            pages.extend(child.pages)
            offset += k * ps
            node = child
        return MatchResult(node, pages)

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

    def insert(self, tokens: list[int], pages: list[int], ready_step: int = READY,
               salt: int = 0) -> tuple[Node, int]:
        """Cache `pages` (one per page of `tokens`, whole pages only) under `salt`.

        Returns the node that ends the prefix and how many leading pages the tree already had:
        the caller's pages from that index on now belong to the tree; the caller's pages before it
        are either the tree's own (a prefix it matched earlier) or duplicates the caller still owns.
        """
        ps = self.page_size
        if len(tokens) != len(pages) * ps:
            raise ValueError("insert takes whole pages: len(tokens) == len(pages) * page_size")
        found = self.match(tokens, salt=salt)
        have = found.num_pages
        node = found.node
        if have < len(pages):
            new = Node(tokens[have * ps :], pages[have:], node, ready_step, salt)
            new.last_access = self._clock
            node.children[self._key(new.tokens, 0, salt)] = new
            self.total_pages += len(new.pages)
            self.evictable_pages += len(new.pages)
            node = new
            if self.listener is not None:
                self.listener.stored(tokens, have, salt)
        return node, have

    def evict(self, n: int) -> list[int]:
        """Free up to n unreferenced pages, least recently used leaves first (tails of nodes)."""
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
                break
            out.extend(node.pages)
            parent = node.parent
            assert parent is not None
            del parent.children[self._key(node.tokens, 0, node.salt)]
            node.parent = None
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, parent)
        self.total_pages -= len(out)
        self.evictable_pages -= len(out)
        return out

    def _tell_removed(self, listener: CacheListener, node: Node, keep: int) -> None:
        chunks: list[list[int]] = []
        up: Node | None = node
        while up is not None and up is not self.root:
            chunks.append(up.tokens)
            up = up.parent
        path = [t for chunk in reversed(chunks) for t in chunk]
        listener.removed(path, len(path) // self.page_size - (len(node.pages) - keep), node.salt)

    def evict_all(self) -> list[int]:
        return self.evict(self.evictable_pages)

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

    def check(self) -> None:
        """Structural invariants; raises AssertionError on the first broken one (tests, debug)."""
        total = evictable = 0
        for node in self._nodes():
            assert node.pages, "empty node"
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
