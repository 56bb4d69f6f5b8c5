"""Which engine a new sequence goes to: round robin, least load, or cache aware, with optional
sticky sessions. Pure logic over `EngineView`s (no I/O), unit-tested in tests/routing.

Load is judged by headroom (headroom.py): the requests that would wait in an engine's queue ahead
of a new one, given its slots, KV pages, reported running and waiting requests, and what the
gateways routed there since its last report; then how full it is.
least_load: the engine with the shortest such queue, then the emptiest.
cache_aware: among the engines whose queue is within `balance_threshold` requests of the shortest,
the one whose prefix cache (exact, from the scheduler's events, plus the predictions of
engine_view) holds the longest prefix of the prompt, i.e. the least prefill work; ties go by
load. A prompt no engine holds goes where the hash of its first pages points (rendezvous) among
engines about as loaded as the least, so several gateways agree on a new prefix's engine without
talking (each one's predictions are its own). So a cache hit wins while its engine would not queue (or
would queue about as much as any other: moving then saves no wait and costs prefill and KV), and
loses once its engine would queue while another would not. Unlike a threshold on request counts
(SGLang's model gateway) this tolerates any imbalance that queues nothing, and unlike a weighted
cost (Dynamo's KV router) it needs no per-model tuning of prefill against decode load.
sticky: a session key (OpenAI `user`, or the x-session-id header) picks its engine by rendezvous
hashing over the usable engines, so a session keeps its engine while the set is stable and only
the sessions of an engine that leaves move; the same queue threshold applies.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from hashlib import blake2b

from minisgl_core.prefix_hash import page_hashes

from minisgl_gateway.engine_view import EngineView
from minisgl_gateway.headroom import fanout, load_key

POLICIES = ("round_robin", "least_load", "cache_aware")
# Requests more in the queue of the engine holding the prefix than in the shortest queue, before
# a request goes elsewhere (and how much fuller an engine may be to take a new prefix by hash). A
# queued request waits for a running one to finish, far longer than the prefill a hit saves; but
# each move copies a prefix to a second engine, and under KV pressure the copies make engines
# queue for pages. In bench.routing_model's model of the 2-engine shared-prefix benchmark 6-12 did
# best: at 2 the copies cost more hits and a longer tail, at 32 slot queues grew.
DEFAULT_BALANCE_THRESHOLD = 8.0
# A new prefix is placed by the hash of its page covering this many tokens: prompts that share
# this much likely share more (a system prompt), and a short chat-template header is not enough to
# pile unrelated prompts onto one engine.
ANCHOR_TOKENS = 256

_Hashes = Callable[[EngineView], list[int]]  # a prompt's page hashes at a view's page size


@dataclass(slots=True)
class Decision:
    view: EngineView
    predicted_tokens: int  # prompt tokens the policy expects the engine to have cached
    reason: str  # "cache" | "load" | "round_robin" | "sticky" | "only" (a single engine)


class Router:
    def __init__(self, policy: str = "cache_aware",
                 balance_threshold: float = DEFAULT_BALANCE_THRESHOLD,
                 sticky: bool = False) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; one of {', '.join(POLICIES)}")
        self.policy = policy
        self.balance_threshold = balance_threshold
        self.sticky = sticky
        self._turn = itertools.count()  # round robin
        self._ties = itertools.count()  # which of equally loaded engines comes first

    def pick(self, views: Sequence[EngineView], input_ids: Sequence[int],
             session: str = "", now: float | None = None) -> Decision:
        """One of `views` (non-empty, all usable); records the choice on the view. `now`: the
        monotonic clock (a simulation passes its own)."""
        if not views:
            raise ValueError("no engine to route to")
        if len(views) == 1:  # nothing to decide: no hashing on the one-engine hot path
            views[0].note_routed((), now)
            return Decision(views[0], 0, "only")
        now = time.monotonic() if now is None else now
        hashes: dict[int, list[int]] = {}  # per page size (engines of one model agree)

        def hashes_for(view: EngineView) -> list[int]:
            if not view.page_size:
                return []
            got = hashes.get(view.page_size)
            if got is None:
                got = hashes[view.page_size] = page_hashes(input_ids, view.page_size)
            return got

        decision = self._decide(views, hashes_for, len(input_ids), session, now)
        view = decision.view
        new_pages = _pages(len(input_ids), view.page_size) - _pages(decision.predicted_tokens,
                                                                    view.page_size)
        view.note_routed(hashes_for(view), now, max(0, new_pages))
        return decision

    def _decide(self, views: Sequence[EngineView], hashes_for: _Hashes, num_tokens: int,
                session: str, now: float) -> Decision:
        if self.policy == "round_robin" and not (self.sticky and session):
            view = views[next(self._turn) % len(views)]
            return self._with_prediction(view, hashes_for, now, "round_robin")
        fan = fanout(views)
        matched = {id(v): v.matched_pages(hashes_for(v), now) for v in views}
        keys = {id(v): load_key(v, fan, _pages(num_tokens, v.page_size) - matched[id(v)])
                for v in views}
        shortest = min(k[0] for k in keys.values())

        def decision(view: EngineView, reason: str) -> Decision:
            return Decision(view, matched[id(view)] * view.page_size, reason)

        if self.sticky and session:
            home = max(views, key=lambda v: _rendezvous(session, v.address))
            if keys[id(home)][0] <= shortest + self.balance_threshold:
                return decision(home, "sticky")
        if self.policy == "round_robin":
            return decision(views[next(self._turn) % len(views)], "round_robin")
        least = self._least_loaded(views, keys)
        if self.policy == "least_load":
            return decision(least, "load")
        best, best_pages = least, 0
        for view in views:
            key, pages = keys[id(view)], matched[id(view)]
            if key[0] > shortest + self.balance_threshold:
                continue  # its queue is too long for a cache hit to make up for
            if pages > best_pages or (pages == best_pages and pages and key < keys[id(best)]):
                best, best_pages = view, pages
        if best_pages:
            return decision(best, "cache")
        hashes = hashes_for(least)
        first = max(1, ANCHOR_TOKENS // least.page_size) if hashes else 0
        anchor = hashes[min(len(hashes), first) - 1] if hashes else None
        return decision(self._home_for_new_prefix(views, keys, anchor) or least, "load")

    def _home_for_new_prefix(self, views: Sequence[EngineView],
                             keys: dict[int, tuple[float, float]],
                             anchor: int | None) -> EngineView | None:
        """For a prompt no engine holds: the engine its anchor page (the page hash covering its
        first ANCHOR_TOKENS) picks by rendezvous hashing over the engine addresses, among those as
        little queued as the least loaded and no more than `balance_threshold` requests fuller.
        Every gateway computes the same, so requests sharing a new prefix that reach several
        gateways at once land on one engine (each gateway's predictions are its own)."""
        if anchor is None:
            return None
        queue, fill = min(keys.values())
        near = [v for v in views if keys[id(v)][0] <= queue
                and (keys[id(v)][1] - fill) * max(1, v.load.max_running_requests)
                <= self.balance_threshold]
        if not near:
            return None
        return max(near, key=lambda v: _rendezvous(str(anchor), v.address))

    def _least_loaded(self, views: Sequence[EngineView],
                      keys: dict[int, tuple[float, float]]) -> EngineView:
        # Ties go round the engines, not always to the first listed.
        start = next(self._ties) % len(views)
        order = list(views[start:]) + list(views[:start])
        return min(order, key=lambda v: keys[id(v)])

    @staticmethod
    def _with_prediction(view: EngineView, hashes_for: _Hashes, now: float,
                         reason: str) -> Decision:
        pages = view.matched_pages(hashes_for(view), now)
        return Decision(view, pages * view.page_size, reason)


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size) if page_size else 0


def _rendezvous(key: str, address: str) -> int:
    digest = blake2b(f"{key}\x00{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
