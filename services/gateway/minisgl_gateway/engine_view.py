"""What the gateway knows of one engine for routing: its load and the pages its prefix cache holds,
both fed by the scheduler's `Watch` stream, plus what this gateway routed there since.

The index is exact (the scheduler's own radix tree, as page hashes). Between a request being routed
and the scheduler caching its prefix, the prefix is "predicted" here for a few seconds, so that a
burst of requests sharing a new system prompt goes to one engine rather than to whichever was
least loaded when each arrived (SMG's approximate tree and Dynamo's active blocks do the same).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from minisgl_core.proto.minisgl.v1 import scheduler_pb2

from minisgl_gateway.headroom import PeerTraffic

PREDICT_TTL_S = 5.0  # longer than any engine takes to report a prefill it admitted
MAX_PREDICTED = 1 << 18  # hashes; past it the oldest predictions are dropped
# A load report reflects the requests that reached the scheduler before its last loop iteration
# ended: routings this recent may be missing from it, so they stay counted as routed since. (Counted
# twice at worst, which makes the engine look a little fuller: the safe side for the queue.)
REPORT_LAG_S = 0.05
MAX_RECENT = 1 << 14


@dataclass
class EngineView:
    address: str
    page_size: int = 0  # 0 until the first Watch message
    seq: int = 0  # last cache-event batch applied (0: none)
    index: set[int] = field(default_factory=set)
    predicted: dict[int, float] = field(default_factory=dict)  # hash -> expiry (monotonic)
    load: scheduler_pb2.EngineLoad = field(default_factory=scheduler_pb2.EngineLoad)
    routed_since_report: int = 0  # this gateway's routings the last report may not include
    routed_pages_since_report: int = 0  # uncached prompt pages of those
    recent: deque[tuple[float, int]] = field(default_factory=deque)  # (when, pages) of those
    routed_in_interval: int = 0  # routings since the last report (for `traffic`)
    traffic: PeerTraffic = field(default_factory=PeerTraffic)  # all gateways' vs this one's
    inflight: int = 0  # this gateway's sequences on the engine
    up: bool = False  # its Connect stream is open
    health_draining: bool = False  # health said NOT_SERVING while the stream is open
    retired: bool = False  # discovery no longer lists it

    # -- Watch stream ------------------------------------------------------------------------

    def apply(self, msg: scheduler_pb2.WatchResponse, now: float | None = None) -> bool:
        """Apply one Watch message; False when a batch is missing (reopen the stream)."""
        if msg.page_size:
            self.page_size = msg.page_size
        if msg.snapshot:
            self.index = set(msg.stored)
            self.seq = msg.seq
        elif msg.stored or msg.removed:
            if msg.seq != self.seq + 1:
                return False
            self.index.update(msg.stored)
            self.index.difference_update(msg.removed)
            self.seq = msg.seq
        if msg.HasField("load"):
            self.traffic.observe(msg.load.arrivals, self.routed_in_interval)
            self.load = msg.load
            self.routed_in_interval = 0
            recent = self.recent
            cutoff = (time.monotonic() if now is None else now) - REPORT_LAG_S
            while recent and recent[0][0] < cutoff:
                recent.popleft()
            self.routed_since_report = len(recent)
            self.routed_pages_since_report = sum(pages for _, pages in recent)
        return True

    # -- routing -----------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self.load.draining or self.health_draining

    @property
    def usable(self) -> bool:
        return self.up and not self.draining and not self.retired

    def matched_pages(self, hashes: Sequence[int], now: float) -> int:
        """Leading pages of a prompt (its page hashes) cached here or predicted to be."""
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
        return n

    def note_routed(self, hashes: Sequence[int], now: float | None = None,
                    new_pages: int = 0) -> None:
        """A sequence was routed here; its prompt has `hashes` and needs `new_pages` uncached."""
        now = time.monotonic() if now is None else now
        self.routed_since_report += 1
        self.routed_pages_since_report += new_pages
        self.routed_in_interval += 1
        self.recent.append((now, new_pages))
        if len(self.recent) > MAX_RECENT:  # no load report for long (its stream is reopening)
            self.recent.popleft()
        if not hashes:
            return
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
