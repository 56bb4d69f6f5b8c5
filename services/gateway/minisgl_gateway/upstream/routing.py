"""Which engine a new sequence goes to: round robin, least load, or cache aware, with optional
sticky sessions. Pure logic over `EngineView`s (no I/O), unit-tested in tests/routing.

cache_aware: the engine whose prefix cache (exact, from the scheduler's events, plus the
predictions of engine_view) holds the longest prefix of the prompt, unless its load exceeds the
least loaded engine's by more than `balance_threshold` requests; then, and when no engine holds any
page of the prompt, the least loaded one (SMG's cache_aware policy balances the same way). And
unless that engine is full: when it would queue the request behind `queue_slack` others (its
running-request limit reached, or a queue reported) while another engine would start it at once,
the request goes to the engine with room that holds the longest prefix. Waiting for a slot costs
a request up to a whole generation of the requests ahead of it; recomputing a prefix elsewhere
costs one prefill.
sticky: a session key (OpenAI `user`, or the x-session-id header) picks its engine by rendezvous
hashing over the usable engines, so a session keeps its engine while the set is stable and only
the sessions of an engine that leaves move; the same balance threshold applies.
A request's cache salt seeds its page hashes as the scheduler's events do (prefix_hash.salt_seed):
a salted prompt matches only pages cached under the same salt. On engines with sliding-window
layers a prefix counts only as far as its window KV is still cached (EngineView.matched_pages).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from hashlib import blake2b

from minisgl_core.prefix_hash import page_hashes, salt_seed

from minisgl_gateway.upstream.engine_view import EngineView

POLICIES = ("round_robin", "least_load", "cache_aware")
DEFAULT_BALANCE_THRESHOLD = 32.0
DEFAULT_QUEUE_SLACK = 4  # requests that may wait at a full engine holding the prefix; < 0: off

_Hashes = Callable[[EngineView], list[int]]  # a prompt's page hashes at a view's page size


@dataclass(slots=True)
class Decision:
    view: EngineView
    predicted_tokens: int  # prompt tokens the policy expects the engine to have cached
    reason: str  # "cache" | "room" | "load" | "round_robin" | "sticky" | "only" (one engine)


class Router:
    def __init__(self, policy: str = "cache_aware",
                 balance_threshold: float = DEFAULT_BALANCE_THRESHOLD,
                 sticky: bool = False, queue_slack: int = DEFAULT_QUEUE_SLACK) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; one of {', '.join(POLICIES)}")
        self.policy = policy
        self.balance_threshold = balance_threshold
        self.sticky = sticky
        self.queue_slack = queue_slack
        self._turn = itertools.count()  # round robin
        self._ties = itertools.count()  # which of equally loaded engines comes first

    def pick(self, views: Sequence[EngineView], input_ids: Sequence[int],
             session: str = "", cache_salt: str = "") -> Decision:
        """One of `views` (non-empty, all usable); records the choice on the view."""
        if not views:
            raise ValueError("no engine to route to")
        if len(views) == 1:  # nothing to decide: no hashing on the one-engine hot path
            views[0].note_routed(())
            return Decision(views[0], 0, "only")
        now = time.monotonic()
        hashes: dict[int, list[int]] = {}  # per page size (engines of one model agree)
        seed = salt_seed(cache_salt)

        def hashes_for(view: EngineView) -> list[int]:
            if not view.page_size:
                return []
            got = hashes.get(view.page_size)
            if got is None:
                got = hashes[view.page_size] = page_hashes(input_ids, view.page_size, seed)
            return got

        decision = self._decide(views, hashes_for, session, now)
        decision.view.note_routed(hashes_for(decision.view), now)
        return decision

    def _decide(self, views: Sequence[EngineView], hashes_for: _Hashes, session: str,
                now: float) -> Decision:
        if self.sticky and session:
            home = max(views, key=lambda v: _rendezvous(session, v.address))
            if home.score - min(v.score for v in views) <= self.balance_threshold:
                return self._with_prediction(home, hashes_for, now, "sticky")
        if self.policy == "round_robin":
            view = views[next(self._turn) % len(views)]
            return self._with_prediction(view, hashes_for, now, "round_robin")
        least = self._least_loaded(views)
        if self.policy == "least_load":
            return self._with_prediction(least, hashes_for, now, "load")
        best, best_pages = least, 0
        for view in views:
            pages = view.matched_pages(hashes_for(view), now)
            if pages > best_pages or (pages == best_pages and pages and view.score < best.score):
                best, best_pages = view, pages
        if best_pages and best.score - least.score <= self.balance_threshold:
            spill = self._spill(best, views, hashes_for, now)
            return spill or Decision(best, best_pages * best.page_size, "cache")
        return self._with_prediction(least, hashes_for, now, "load")

    def _spill(self, home: EngineView, views: Sequence[EngineView], hashes_for: _Hashes,
               now: float) -> Decision | None:
        """Another engine, with room, for a request `home` would queue; None to stay."""
        room = home.room
        if self.queue_slack < 0 or room is None or room > -self.queue_slack:
            return None
        best: tuple[int, float, EngineView] | None = None
        for view in views:
            other = view.room
            if view is home or other is None or other <= 0:
                continue
            cand = (view.matched_pages(hashes_for(view), now), other, view)
            if best is None or cand[:2] > best[:2]:
                best = cand
        if best is None:  # every engine is full: queue where the prefix is
            return None
        return Decision(best[2], best[0] * best[2].page_size, "room")

    def _least_loaded(self, views: Sequence[EngineView]) -> EngineView:
        # Ties go round the engines, not always to the first listed.
        start = next(self._ties) % len(views)
        order = list(views[start:]) + list(views[:start])
        return min(order, key=lambda v: v.score)

    @staticmethod
    def _with_prediction(view: EngineView, hashes_for: _Hashes, now: float,
                         reason: str) -> Decision:
        pages = view.matched_pages(hashes_for(view), now)
        return Decision(view, pages * view.page_size, reason)


def _rendezvous(key: str, address: str) -> int:
    digest = blake2b(f"{key}\x00{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
