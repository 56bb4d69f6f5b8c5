"""How much room an engine has for one more request, as the routing policies see it: the requests
that would wait ahead of it in the engine's queue, and how full the engine is.

An engine runs at most `max_running_requests` requests (its slots) and as many as its KV pages
hold; the rest wait in its queue until running requests end, and that wait (a whole request's
lifetime under saturation) is what makes a time-to-first-token tail. So an
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


def free_pages(view: EngineView, fan: float) -> float:
    """KV pages the engine could give new requests: those no request holds (the prefix cache's
    unlocked pages are evictable), less the uncached pages of the prompts routed there since."""
    load = view.load
    return load.total_pages - load.used_pages - view.routed_pages_since_report * fan


def queue_ahead(view: EngineView, fan: float, need_pages: int = 0) -> float:
    """Requests that would wait in the engine's queue for a slot or for KV pages, counting one
    routed there now that needs `need_pages` new pages; 0 when it would be admitted as soon as the
    prefill ahead of it allows. Waiting requests alone are not a queue: after a burst they only
    wait for their turn in the prefill budget (the scheduler admits them over the next steps).
    With the slots unknown (an older engine) every request on the engine counts, which makes the
    policies plain load balancers."""
    slots = view.load.max_running_requests
    occ = occupancy(view, fan)
    if not slots:
        return occ
    queued = max(0.0, occ + 1.0 - slots)
    if view.load.total_pages and need_pages > free_pages(view, fan):
        # No pages for it: it waits behind whatever else waits, for running requests to end.
        queued = max(queued, view.load.waiting_requests + view.routed_since_report * fan + 1.0)
    return queued


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


def load_key(view: EngineView, fan: float, need_pages: int = 0) -> tuple[float, float]:
    """Less is better: the queue a new request would join, then how full the engine is."""
    return queue_ahead(view, fan, need_pages), fill(view, fan)
