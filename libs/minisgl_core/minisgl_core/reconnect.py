"""Finding a service again after it went away: capped reconnect backoff for every gRPC channel,
and one jittered retry delay for loops that reopen a stream.

gRPC's defaults back off from 1 s up to 120 s between connection attempts (x1.6 each, +-20 %
jitter, doc/connection-backoff.md in grpc), so after a long outage a channel may wait two minutes
more after the service is back. Here attempts start 100 ms apart and never wait more than 1 s
(grpc still jitters each by +-20 %), which a loopback or cluster network easily affords: a
service that turns healthy is reached within about a second. `grpc.min_reconnect_backoff_ms` is
grpc's minimum connect timeout (default 20 s): one attempt at an address that does not answer
(a vanished pod IP) gives up after 5 s instead of 20.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

INITIAL_BACKOFF_MS = 100
MAX_BACKOFF_MS = 1_000
CONNECT_TIMEOUT_MS = 5_000

RECONNECT_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", INITIAL_BACKOFF_MS),
    ("grpc.max_reconnect_backoff_ms", MAX_BACKOFF_MS),
    ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
]


@dataclass
class Backoff:
    """Delays between attempts to reopen a stream: exponential from `initial` to `cap` seconds,
    each drawn uniformly from [delay/2, delay] so that many clients cut off at once (every
    gateway, when a scheduler restarts) do not retry in lockstep. `reset` after a success."""

    initial: float = 0.05
    cap: float = 1.0
    factor: float = 2.0
    _delay: float = 0.0

    def next(self) -> float:
        self._delay = min(self.cap, self._delay * self.factor) if self._delay else self.initial
        return random.uniform(self._delay / 2, self._delay)

    def reset(self) -> None:
        self._delay = 0.0
