"""SLO-aware admission: refuse a request at once (503 + Retry-After) when the engines' queues say
its first token would come later than --ttft-slo-ms, rather than accept it and let it time out.

The estimate: requests queued ahead of it on the engine the router would favour (the shortest
queue, from the Watch stream's load, `EngineView.room`), over the rate at which this gateway has
seen requests get their first token lately (the queue's drain rate). With no recent first token
there is no evidence, and the request is let through.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from minisgl_gateway.errors import ApiError
from minisgl_gateway.upstream.engine_view import EngineView

WINDOW_S = 10.0  # first tokens counted for the drain rate
_MAX_SAMPLES = 1 << 16


class FirstTokenRate:
    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=_MAX_SAMPLES)

    def record(self, now: float) -> None:
        self._times.append(now)

    def rate(self, now: float) -> float:
        """First tokens per second over the last WINDOW_S (0.0: none)."""
        times = self._times
        while times and times[0] < now - WINDOW_S:
            times.popleft()
        if not times:
            return 0.0
        # Over the span actually observed, so that a fresh burst is not diluted by idle seconds.
        span = max(now - times[0], 1.0)
        return len(times) / span


def queued_ahead(views: Iterable[EngineView]) -> int | None:
    """Requests queued ahead of a new one on the engine with the shortest queue (None: no
    usable engine)."""
    best: float | None = None
    for view in views:
        room = view.room
        ahead = float(view.load.waiting_requests) if room is None else max(0.0, -room)
        best = ahead if best is None else min(best, ahead)
    return None if best is None else int(best)


def check_ttft(slo_ms: float, ahead: int | None, rate: float) -> None:
    """Raise 503 + Retry-After when `ahead` requests draining at `rate` per second miss the SLO."""
    if slo_ms <= 0 or not ahead or rate <= 0:
        return
    wait_s = ahead / rate
    if wait_s * 1000.0 <= slo_ms:
        return
    raise ApiError(503, f"{ahead} requests are queued ahead: the first token would take about "
                   f"{wait_s * 1000:.0f} ms, over the {slo_ms:.0f} ms target; retry later",
                   code="slo_unattainable", retry_after=max(1, math.ceil(wait_s - slo_ms / 1000)))
