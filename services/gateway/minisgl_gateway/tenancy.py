"""Per-API-key admission: quotas (requests in flight, tokens per minute), a fair share of the
gateway's concurrency when several keys compete for it, and the tenant id the scheduler
interleaves by. Every check is off unless its flag is set (config.TenantLimits).

A key is known by a 64-bit hash of its bearer token (never the token itself): requests without
one share tenant 0. Tokens per minute is a token bucket charged when a request ends, with its
prompt + completion tokens: a key may overdraw it with one request, and then waits until it
refills (Retry-After says how long).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import blake2b

from minisgl_gateway.config import TenantLimits
from minisgl_gateway.errors import ApiError

# A key that sent a request this recently competes for a fair share, even with none in flight
# right now (a closed-loop client between two requests, or one just refused).
RECENT_S = 2.0
_PRUNE_AT = 4096  # keys tracked before idle ones are forgotten


def tenant_of(authorization: str | None) -> int:
    """The tenant id of a request's `Authorization` value ("Bearer KEY"); 0 without a key."""
    key = (authorization or "").strip().partition(" ")[2].strip()
    if not key:
        return 0
    digest = blake2b(key.encode("utf-8", "replace"), digest_size=8, person=b"minisgl-tenant")
    return int.from_bytes(digest.digest(), "big") or 1


def quota_error(message: str, retry_after: float) -> ApiError:
    return ApiError(429, message, code="rate_limit_exceeded",
                    retry_after=max(1, math.ceil(retry_after)))


@dataclass
class KeyState:
    in_flight: int = 0
    tokens: float = 0.0  # the token bucket's level (may go negative: an overdraft)
    refilled_at: float = 0.0
    seen_at: float = 0.0


class Tenancy:
    def __init__(self, config: TenantLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.keys: dict[int, KeyState] = {}

    @property
    def enabled(self) -> bool:
        c = self.config
        return bool(c.key_max_in_flight or c.key_tokens_per_minute or c.key_fair_share)

    def _state(self, tenant: int, now: float) -> KeyState:
        state = self.keys.get(tenant)
        if state is None:
            if len(self.keys) >= _PRUNE_AT:
                self.keys = {t: s for t, s in self.keys.items()
                             if s.in_flight or now - s.seen_at < RECENT_S or s.tokens < 0}
            state = self.keys[tenant] = KeyState(
                tokens=float(self.config.key_tokens_per_minute), refilled_at=now)
        return state

    def _refill(self, state: KeyState, now: float) -> None:
        tpm = self.config.key_tokens_per_minute
        state.tokens = min(float(tpm), state.tokens + (now - state.refilled_at) * tpm / 60.0)
        state.refilled_at = now

    def fair_share(self, now: float, limit: int, me: KeyState) -> tuple[float, float]:
        """The concurrency share of each competing key, and the slots the other competing keys
        lack to reach it (kept free for them)."""
        competing = [s for s in self.keys.values()
                     if s.in_flight or now - s.seen_at < RECENT_S]
        share = limit / max(1, len(competing))
        return share, sum(max(0.0, share - s.in_flight) for s in competing if s is not me)

    def seen(self, tenant: int) -> None:
        """A request of the key arrived (even one refused before `admit`): with fair sharing on,
        the key competes for a share for the next RECENT_S seconds."""
        if self.config.key_fair_share:
            now = self.clock()
            self._state(tenant, now).seen_at = now

    def admit(self, tenant: int, active: int, limit: int, retry_after: int) -> None:
        """Raise 429 when the key is past a quota, or past its fair share of `limit` while the
        gateway has `active` requests; else count one more request of the key in flight."""
        if not self.enabled:
            return
        c, now = self.config, self.clock()
        state = self._state(tenant, now)
        state.seen_at = now
        if c.key_max_in_flight and state.in_flight >= c.key_max_in_flight:
            raise quota_error(f"this API key has {state.in_flight} requests in flight (limit "
                              f"{c.key_max_in_flight}); retry when one ends", retry_after)
        if c.key_tokens_per_minute:
            self._refill(state, now)
            if state.tokens <= 0:
                wait = (1.0 - state.tokens) * 60.0 / c.key_tokens_per_minute
                raise quota_error(f"this API key used its {c.key_tokens_per_minute} tokens per "
                                  f"minute; retry in {math.ceil(wait)} s", wait)
        if c.key_fair_share:
            share, owed = self.fair_share(now, limit, state)
            # Work-conserving: past its share a key may still take a free slot, as long as
            # enough stay free for every other competing key to reach its share.
            if state.in_flight >= share and active + owed >= limit:
                raise quota_error(f"this API key holds {state.in_flight} of the gateway's "
                                  f"{limit} request slots, its fair share while other keys "
                                  "wait; retry later", retry_after)
        state.in_flight += 1

    def release(self, tenant: int) -> None:
        if not self.enabled:
            return
        state = self.keys.get(tenant)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1

    def charge(self, tenant: int, tokens: int) -> None:
        """A request of the key ended having used `tokens` (prompt + completion)."""
        if not self.config.key_tokens_per_minute or tokens <= 0:
            return
        now = self.clock()
        state = self._state(tenant, now)
        self._refill(state, now)
        state.tokens -= tokens
