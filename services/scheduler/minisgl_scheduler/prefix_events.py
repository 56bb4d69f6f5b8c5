"""The prefix cache's changes as a numbered event log, for routers that place requests where their
prefix is cached (the `Watch` RPC).

The radix tree calls `stored`/`removed` as pages enter and leave it; the loop thread `flush`es what
one iteration changed as one batch with the next seq. Subscribers (gRPC threads) read the batches
after the seq they hold, or take a snapshot of the whole tree when they start or fell behind the
bounded ring. With no subscriber the hooks return at once and nothing is kept: the log is then
"broken" on purpose (seq jumps, ring cleared), so a later resume gets a snapshot, never a silent gap.

Pages are named by `minisgl_core.prefix_hash.page_hashes` over the tokens from the root, chained
from the request's salt seed, the same names a gateway computes for a prompt with that salt.

A tree with a window pool (sliding-window layers) also reports, per page, whether its window-pool
KV is cached (`window_stored` / `window_removed`): a prefix whose full-attention KV is cached but
whose last window is not hits shorter, and a router that knows only main pages over-predicts.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from minisgl_core.prefix_hash import page_hashes

from minisgl_scheduler.radix import Node, RadixCache

RING_BATCHES = 1024  # iterations a subscriber may fall behind before it needs a snapshot


@dataclass(slots=True)
class EventBatch:
    seq: int
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    window_stored: list[int] = field(default_factory=list)  # windowed trees only
    window_removed: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Subscription:
    cursor: int  # the last seq this subscriber has
    snapshot: list[int] | None  # every cached page hash, when it starts from a snapshot
    window_snapshot: list[int] | None = None  # of those, the pages with window KV (windowed)


class PrefixEventLog:
    def __init__(self, page_size: int, ring_batches: int = RING_BATCHES,
                 on_batch: Callable[[], None] | None = None) -> None:
        self.page_size = page_size
        self._on_batch = on_batch  # told after each new batch (wakes the Watch streams)
        self.active = False  # any subscriber: read by the hooks on the loop thread
        self._subscribers = 0
        self._pending: dict[int, bool] = {}  # hash -> cached after this iteration (last op wins)
        self._win_pending: dict[int, bool] = {}  # the same for window-pool KV
        self._ring: deque[EventBatch] = deque(maxlen=ring_batches)
        self._seq = 0
        self._base = 0  # the ring holds every batch with seq in (base, seq]
        self._cond = threading.Condition()

    # -- hooks (loop thread, via RadixCache.listener) ------------------------------------------

    def stored(self, tokens: list[int], first_new_page: int, salt: int = 0) -> None:
        """`tokens` (whole pages from the root) are cached; pages from `first_new_page` are new."""
        if self.active:
            for h in page_hashes(tokens, self.page_size, salt)[first_new_page:]:
                self._pending[h] = True

    def removed(self, path_tokens: list[int], first_removed_page: int, salt: int = 0) -> None:
        """The pages of `path_tokens` (from the root) from `first_removed_page` on were evicted."""
        if self.active:
            for h in page_hashes(path_tokens, self.page_size, salt)[first_removed_page:]:
                self._pending[h] = False

    def window(self, path_tokens: list[int], pages: list[int], kept: bool, salt: int = 0) -> None:
        """The window-pool KV of `pages` (indices into the pages of `path_tokens`) came or went."""
        if self.active:
            hashes = page_hashes(path_tokens, self.page_size, salt)
            for i in pages:
                self._win_pending[hashes[i]] = kept

    def flush(self) -> None:
        """End of a loop iteration: what changed becomes one numbered batch."""
        if not self._pending and not self._win_pending:
            return
        batch = EventBatch(0)
        for h, cached in self._pending.items():
            (batch.stored if cached else batch.removed).append(h)
        for h, cached in self._win_pending.items():
            (batch.window_stored if cached else batch.window_removed).append(h)
        self._pending, self._win_pending = {}, {}
        with self._cond:
            self._seq += 1
            batch.seq = self._seq
            if len(self._ring) == self._ring.maxlen:
                self._base = self._ring[0].seq
            self._ring.append(batch)
            self._cond.notify_all()
        if self._on_batch is not None:
            self._on_batch()

    # -- subscribers ---------------------------------------------------------------------------

    def subscribe(self, resume_after: int, cache: RadixCache | None) -> Subscription:
        """Loop thread only (the snapshot must not race the hooks)."""
        with self._cond:
            self._subscribers += 1
            self.active = True
            if resume_after and self._base <= resume_after <= self._seq:
                return Subscription(resume_after, None)
        return Subscription(*self.snapshot(cache))

    @property
    def subscribers(self) -> int:
        """Watch streams open now (about one per gateway: routers scale their estimates by it)."""
        return self._subscribers

    def snapshot(self, cache: RadixCache | None) -> tuple[int, list[int], list[int] | None]:
        """(seq, every cached page hash, those with window KV: None without a window pool) as of
        now. Loop thread only."""
        self.flush()
        hashes: list[int] = []
        windowed = cache is not None and cache.windowed
        win: list[int] | None = [] if windowed else None
        if cache is not None:
            # A chain starts at its namespace's seed (0 without a salt).
            stack: list[tuple[Node, int]] = [(c, c.salt) for c in cache.root.children.values()]
            while stack:
                node, parent = stack.pop()
                own = page_hashes(node.tokens, self.page_size, parent)
                hashes += own
                if win is not None:
                    win += [h for h, p in zip(own, node.win, strict=True) if p >= 0]
                stack.extend((c, own[-1]) for c in node.children.values())
        with self._cond:
            return self._seq, hashes, win

    def unsubscribe(self) -> None:
        with self._cond:
            self._subscribers -= 1
            if self._subscribers == 0:
                # Nothing is recorded from now on: make any later resume take a snapshot.
                self.active = False
                self._ring.clear()
                self._seq += 1
                self._base = self._seq

    def since(self, cursor: int, timeout: float) -> list[EventBatch] | None:
        """Batches after `cursor`, waiting up to `timeout` for one; None: `cursor` fell out of the
        ring (take a snapshot)."""
        with self._cond:
            if cursor == self._seq and timeout > 0:
                self._cond.wait(timeout)
            if cursor < self._base:
                return None
            return [b for b in self._ring if b.seq > cursor]
