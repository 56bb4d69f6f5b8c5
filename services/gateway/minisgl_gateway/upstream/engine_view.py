"""What the gateway knows of one engine for routing: its load and the pages its prefix cache holds,
both fed by the scheduler's `Watch` stream, plus what this gateway routed there since.

The index is exact (the scheduler's own radix tree, as page hashes). Between a request being routed
and the scheduler caching its prefix, the prefix is "predicted" here for a few seconds, so that a
burst of requests sharing a new system prompt goes to one engine rather than to whichever was
least loaded when each arrived (SMG's approximate tree and Dynamo's active blocks do the same).

An engine whose scheduler is up but whose worker is not (died, restarting) is not usable: its
scheduler says so in its load reports (`worker_down`), and this gateway holds it back on its own for
`WORKER_HOLD_S` after a stream failed there for that reason, since the report that says so may come
a moment after the failure (Watch and Connect are separate streams). Otherwise it would look like
the least loaded engine of all (its requests just failed) and draw every new and migrated stream,
each failing at once.

An engine with sliding-window layers (its Watch messages say `window`) keeps those layers' KV in a
second pool that it evicts on its own: a cached prefix is a usable hit only up to where the pages
its next query's window reads still have window KV (`win_index`, from `window_stored` /
`window_removed`), so `matched_pages` is cut there, as the engine's own match is.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from minisgl_core.proto.minisgl.v1 import scheduler_pb2

PREDICT_TTL_S = 5.0  # longer than any engine takes to report a prefill it admitted
MAX_PREDICTED = 1 << 18  # hashes; past it the oldest predictions are dropped
WORKER_HOLD_S = 1.0  # ten load reports: the scheduler has said by then whether its worker is gone


@dataclass
class EngineView:
    address: str
    page_size: int = 0  # 0 until the first Watch message
    seq: int = 0  # last cache-event batch applied (0: none)
    index: set[int] = field(default_factory=set)
    window: int = 0  # the engine's sliding window in tokens (0: no window pool)
    win_index: set[int] = field(default_factory=set)  # pages whose window KV is cached too
    predicted: dict[int, float] = field(default_factory=dict)  # hash -> expiry (monotonic)
    load: scheduler_pb2.EngineLoad = field(default_factory=scheduler_pb2.EngineLoad)
    routed_since_report: int = 0
    inflight: int = 0  # this gateway's sequences on the engine
    up: bool = False  # its Connect stream is open
    health_draining: bool = False  # health said NOT_SERVING while the stream is open
    retired: bool = False  # discovery no longer lists it
    held_until: float = 0.0  # monotonic: a stream failed here for a lost worker (hold_worker)

    # -- Watch stream ------------------------------------------------------------------------

    def apply(self, msg: scheduler_pb2.WatchResponse) -> bool:
        """Apply one Watch message; False when a batch is missing (reopen the stream)."""
        if msg.page_size:  # every message of an engine says both (window 0 from older ones)
            self.page_size = msg.page_size
            self.window = msg.window
        if msg.snapshot:
            self.index = set(msg.stored)
            self.win_index = set(msg.window_stored)
            self.seq = msg.seq
        elif msg.stored or msg.removed or msg.window_stored or msg.window_removed:
            if msg.seq != self.seq + 1:
                return False
            self.index.update(msg.stored)
            self.index.difference_update(msg.removed)
            if self.window or msg.window_stored or msg.window_removed:
                win = self.win_index
                win.update(msg.window_stored)
                win.difference_update(msg.window_removed)
                win.difference_update(msg.removed)  # a page evicted loses its window KV too
            self.seq = msg.seq
        if msg.HasField("load"):
            self.load = msg.load
            self.routed_since_report = 0
        return True

    # -- routing -----------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self.load.draining or self.health_draining

    @property
    def worker_down(self) -> bool:
        if self.load.worker_down:
            return True
        return bool(self.held_until) and time.monotonic() < self.held_until

    @property
    def usable(self) -> bool:
        return self.up and not self.draining and not self.retired and not self.worker_down

    def hold_worker(self, now: float | None = None) -> None:
        """A sequence failed here because the worker is gone: route around the engine for a
        moment, until its own reports can be trusted to say whether the worker is back."""
        self.held_until = (time.monotonic() if now is None else now) + WORKER_HOLD_S

    @property
    def score(self) -> float:
        """Requests on the engine (reported, plus those routed here since the report), with the
        KV pages in use as a tie-break below one request."""
        reported = self.load.running_requests + self.load.waiting_requests
        requests = max(reported + self.routed_since_report, self.inflight)
        kv = self.load.used_pages / self.load.total_pages if self.load.total_pages else 0.0
        return requests + 0.5 * kv

    @property
    def room(self) -> float | None:
        """Requests the engine would start at once if sent now (<= 0: a new one would queue),
        as this gateway estimates it; None when the engine does not report its limit.

        Since the last report this gateway routed `routed_since_report` here; each of the other
        gateways watching the engine presumably routed as many (the unbiased guess without
        their counts). An engine that reports a queue already queues whatever comes next."""
        cap = self.load.max_running_requests
        if not cap:
            return None
        extra = self.routed_since_report * max(1, self.load.watchers)
        if self.load.waiting_requests:
            return -float(self.load.waiting_requests + extra)
        return float(min(cap - self.load.running_requests - extra, cap - self.inflight))

    def matched_pages(self, hashes: Sequence[int], now: float) -> int:
        """Leading pages of a prompt (its page hashes) cached here or predicted to be; on an
        engine with a window pool, only as many as its windowed layers can carry on from."""
        n = 0
        index, predicted = self.index, self.predicted
        for h in hashes:
            if h in index:
                n += 1
                continue
            expiry = predicted.get(h)
            if expiry is None or expiry < now:
                break
            n += 1
        if self.window and n:
            return self._usable(hashes, n, now)
        return n

    def _usable(self, hashes: Sequence[int], n: int, now: float) -> int:
        """The longest h <= n whose pages from the first one a query at h * page_size reads are
        all cached with window KV (or predicted: a prompt routed here leaves its window cached);
        the scheduler's kv_window.usable_pages over page hashes."""
        ps, window, win, predicted = self.page_size, self.window, self.win_index, self.predicted
        run = best = 0
        for h in range(1, n + 1):
            key = hashes[h - 1]
            if key in win or predicted.get(key, -1.0) >= now:
                run += 1
            else:
                run = 0
            if run >= h - max(0, (h * ps - window + 1) // ps):
                best = h
        return best

    def note_routed(self, hashes: Sequence[int], now: float | None = None) -> None:
        self.routed_since_report += 1
        if not hashes:
            return
        now = time.monotonic() if now is None else now
        predicted = self.predicted
        if len(predicted) + len(hashes) > MAX_PREDICTED:
            self.prune(now)
            while len(predicted) + len(hashes) > MAX_PREDICTED and predicted:
                del predicted[next(iter(predicted))]
        expiry = now + PREDICT_TTL_S
        for h in hashes:
            if h not in self.index:
                predicted.pop(h, None)  # re-inserted at the end: dict order stays expiry order
                predicted[h] = expiry

    def prune(self, now: float) -> None:
        predicted = self.predicted
        while predicted:
            h = next(iter(predicted))
            if predicted[h] >= now:
                break
            del predicted[h]
