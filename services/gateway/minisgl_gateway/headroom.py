"""How much room an engine has for one more request, as the routing policies see it: the requests
that would wait ahead of it in the engine's queue, and how full the engine is.

An engine runs at most `max_running_requests` requests (its slots) and as many as its KV pages
hold; the rest wait in its queue, and that wait is what makes a time-to-first-token tail. So an
imbalance between engines costs nothing while the busier one still has free slots and KV, and a
lot once it queues. The estimate starts from the engine's last load report (every ~100 ms) and adds
what was routed there since: this gateway's own routings, scaled by `fanout`, the number of
requests all gateways together route per request this one routes. Gateways see each other only
through the reports, so each one assumes the others route like itself (clients spread evenly over
gateways) and learns the ratio from the engine's arrival counter: the counter's growth between
two reports against this gateway's own routings in that interval.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minisgl_gateway.engine_view import EngineView

SMOOTHING = 0.3  # weight of the newest report interval in the traffic averages
MAX_FANOUT = 64.0  # more gateways than this in front of one engine pool is not assumed


@dataclass(slots=True)
class PeerTraffic:
    """Requests reaching one engine per report interval from all gateways, and from this one
    (exponential averages over the intervals)."""

    last_arrivals: int = -1  # the engine's counter at the last report (-1: none yet)
    total: float = 0.0
    own: float = 0.0

    def observe(self, arrivals: int, own_routed: int) -> None:
        """A load report: the engine's arrival counter, and what this gateway routed there since
        the previous report."""
        if self.last_arrivals < 0 or arrivals < self.last_arrivals:  # first report, or a restart
            self.last_arrivals = arrivals
            return
        delta = arrivals - self.last_arrivals
        self.last_arrivals = arrivals
        self.total += SMOOTHING * (delta - self.total)
        self.own += SMOOTHING * (own_routed - self.own)


def fanout(views: Iterable[EngineView]) -> float:
    """Requests routed by all gateways per request routed by this one (1 until learned)."""
    total = own = 0.0
    for v in views:
        total += v.traffic.total
        own += v.traffic.own
    if own <= 0.0:
        return 1.0
    return min(MAX_FANOUT, max(1.0, total / own))


def occupancy(view: EngineView, fan: float) -> float:
    """Requests on the engine: reported running and waiting, plus those routed there since the
    report by every gateway (estimated), at least this gateway's own live sequences there."""
    load = view.load
    reported = load.running_requests + load.waiting_requests
    return max(reported + view.routed_since_report * fan, float(view.inflight))


def capacity(view: EngineView) -> float:
    """Requests the engine can run at once now: its slots, fewer when its free KV pages (at the
    running requests' average size) would run out first, and no more than it runs while
    something already waits (it is admitting nothing more). 0: unknown (an older engine)."""
    load = view.load
    slots = float(load.max_running_requests)
    if not slots:
        return 0.0
    running = load.running_requests
    if load.waiting_requests:
        return min(slots, float(running))
    if running and load.used_pages:
        free = max(0, load.total_pages - load.used_pages)
        slots = min(slots, running + free * running / load.used_pages)
    return slots


def queue_ahead(view: EngineView, fan: float) -> float:
    """Requests that would wait in the engine's queue, counting one routed there now; 0 when it
    would get a slot and its pages at once. With the capacity unknown every request on the engine
    counts, which makes the policies plain load balancers."""
    occ = occupancy(view, fan)
    if not view.load.max_running_requests:
        return occ
    return max(0.0, occ + 1.0 - capacity(view))


def fill(view: EngineView, fan: float) -> float:
    """How full the engine is: occupancy over its slots (requests when the slots are unknown),
    with the KV pages in use as a tie-break below one request."""
    load = view.load
    occ = occupancy(view, fan)
    slots = load.max_running_requests
    kv = load.used_pages / load.total_pages if load.total_pages else 0.0
    if slots:
        return (occ + 0.5 * kv) / slots
    return occ + 0.5 * kv


def load_key(view: EngineView, fan: float) -> tuple[float, float]:
    """Less is better: the queue a new request would join, then how full the engine is."""
    return queue_ahead(view, fan), fill(view, fan)
