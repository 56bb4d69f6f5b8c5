"""Queue-aware routing over hand-made engine views (no I/O): a cache hit wins while its engine
would not queue, however unequal the loads; it loses once its engine queues (for slots or for KV
pages) while another would not; equal queues keep it; several gateways are accounted for by the
fanout learned from the engines' arrival counters; least_load compares headroom, not counts."""

from __future__ import annotations

import math
import time

from minisgl_core.prefix_hash import page_hashes
from minisgl_core.proto.minisgl.v1 import scheduler_pb2
from minisgl_gateway.engine_view import EngineView
from minisgl_gateway.headroom import PeerTraffic, fanout, queue_ahead
from minisgl_gateway.routing import Router

PS = 4
PROMPT = list(range(64))


def _views(n: int) -> list[EngineView]:
    return [EngineView(f"10.0.0.{i}:1", page_size=PS, up=True) for i in range(n)]


def _report(v: EngineView, running: int, waiting: int = 0, slots: int = 256,
            used: int = 0, total: int = 10_000, arrivals: int = 0,
            now: float = math.inf) -> None:
    """A load report, by default long after every routing so far (it includes them all)."""
    v.apply(scheduler_pb2.WatchResponse(seq=v.seq, load=scheduler_pb2.EngineLoad(
        running_requests=running, waiting_requests=waiting, max_running_requests=slots,
        used_pages=used, total_pages=total, arrivals=arrivals)), now)


def _cached_on(v: EngineView) -> None:
    v.index = set(page_hashes(PROMPT, PS))


def test_an_unqueued_cache_hit_wins_however_unequal_the_loads() -> None:
    views = _views(2)
    _cached_on(views[0])
    _report(views[0], running=200)  # 200 of 256 slots, nothing waiting
    _report(views[1], running=10)
    d = Router("cache_aware").pick(views, PROMPT)
    assert d.view is views[0] and d.reason == "cache" and d.predicted_tokens == len(PROMPT)


def test_a_saturated_cache_engine_loses_to_one_with_free_slots() -> None:
    views = _views(2)
    _cached_on(views[0])
    _report(views[0], running=256, waiting=20)  # 21 would queue: past the default 8
    _report(views[1], running=200)
    d = Router("cache_aware").pick(views, PROMPT)
    assert d.view is views[1] and d.reason == "load" and d.predicted_tokens == 0


def test_equal_queues_keep_the_cache_hit() -> None:
    views = _views(2)
    _cached_on(views[0])
    _report(views[0], running=256, waiting=20)
    _report(views[1], running=256, waiting=19)  # one shorter: within the threshold
    assert Router("cache_aware").pick(views, PROMPT).view is views[0]
    _report(views[1], running=256, waiting=10)  # clearly shorter
    assert Router("cache_aware").pick(views, PROMPT).view is views[1]


def test_waiting_for_the_prefill_budget_is_not_a_queue() -> None:
    """After a burst an engine lists many waiting requests that only wait for their turn in the
    prefill budget (slots and pages are there): the cache hit still wins."""
    views = _views(2)
    _cached_on(views[0])
    _report(views[0], running=50, waiting=150, used=2_000)
    _report(views[1], running=100, used=2_000)
    assert queue_ahead(views[0], 1.0) == 0
    d = Router("cache_aware").pick(views, PROMPT)
    assert d.view is views[0] and d.reason == "cache"


def test_a_prompt_that_does_not_fit_the_free_pages_queues() -> None:
    views = _views(2)
    _cached_on(views[0])
    prompt = PROMPT + list(range(1000, 1064))  # 16 cached pages on engine 0, 16 new ones
    _report(views[0], running=100, used=9_990)  # 10 pages free: too few
    _report(views[1], running=100, used=5_000)
    assert queue_ahead(views[0], 1.0, need_pages=16) == 1 and queue_ahead(views[0], 1.0, 10) == 0
    assert Router("cache_aware", balance_threshold=0).pick(views, prompt).view is views[1]
    # The fully cached prompt needs no new page: it still fits.
    assert Router("cache_aware", balance_threshold=0).pick(views, PROMPT).view is views[0]
    # Behind 10 requests already waiting there: past the default threshold too.
    _report(views[0], running=100, waiting=10, used=9_990)
    assert Router("cache_aware").pick(views, prompt).view is views[1]


def test_the_pages_routed_since_the_report_count_against_the_free_ones() -> None:
    views = _views(2)
    _report(views[0], running=10, used=9_900)  # 100 pages free
    _report(views[1], running=10, used=9_900)
    router = Router("least_load", balance_threshold=0)
    for i in range(12):  # 16 new pages each: 6 fit on each engine, then both queue
        d = router.pick(views, [i] + PROMPT[1:])
        assert d.predicted_tokens == 0
    assert views[0].routed_since_report == views[1].routed_since_report == 6
    assert views[0].routed_pages_since_report == views[1].routed_pages_since_report == 6 * 16
    assert queue_ahead(views[0], 1.0, 16) > 0 and queue_ahead(views[1], 1.0, 16) > 0


def test_a_burst_fills_the_cache_engine_up_to_its_free_slots_then_spills() -> None:
    views = _views(2)
    _cached_on(views[0])
    _report(views[0], running=240)
    _report(views[1], running=100)
    router = Router("cache_aware", balance_threshold=2)
    picks = [router.pick(views, PROMPT).view for _ in range(40)]
    first_away = picks.index(views[1])
    assert first_away == 16 + 2  # 16 free slots, then 2 queued (the threshold)
    assert views[0].routed_since_report == first_away


def test_several_gateways_make_each_one_more_conservative() -> None:
    """Four gateways route alike: the engines' arrival counters grow four times as fast as this
    gateway's routings, so each of its routings stands for four."""
    views = _views(2)
    arrivals = [0, 0]
    for v in views:
        _report(v, running=100)
    for _ in range(10):  # report intervals: this gateway routes 5 to each, all gateways 20
        for i, v in enumerate(views):
            v.routed_in_interval = 5
            arrivals[i] += 20
            _report(v, running=100, arrivals=arrivals[i])
    assert 3.5 < fanout(views) <= 4.0
    _cached_on(views[0])
    _report(views[0], running=240, arrivals=arrivals[0])
    _report(views[1], running=100, arrivals=arrivals[1])
    router = Router("cache_aware", balance_threshold=2)
    picks = [router.pick(views, PROMPT).view for _ in range(40)]
    # (16 free slots + 2) / ~4 routings before the engine is estimated to queue past the margin
    assert 4 <= picks.index(views[1]) <= 5


def test_fanout_is_one_until_learned_and_survives_an_engine_restart() -> None:
    views = _views(1)
    assert fanout(views) == 1.0
    t = PeerTraffic()
    t.observe(100, 0)  # first report: a baseline only
    assert t.total == 0.0
    t.observe(130, 10)
    assert t.total > 0 and t.own > 0
    before = (t.total, t.own)
    t.observe(3, 10)  # the counter went back: the engine restarted; a new baseline
    assert (t.total, t.own) == before and t.last_arrivals == 3


def test_least_load_compares_headroom_not_request_counts() -> None:
    views = _views(2)
    _report(views[0], running=300, slots=512)  # more requests, more room
    _report(views[1], running=200, slots=256)
    assert Router("least_load").pick(views, [1] * 8).view is views[0]
    _report(views[0], running=512, waiting=3, slots=512)  # now it queues
    assert Router("least_load").pick(views, [1] * 8).view is views[1]


def test_sticky_sessions_leave_a_queued_home() -> None:
    views = _views(2)
    router = Router("cache_aware", sticky=True)
    home = router.pick(views, [1], "user-1").view
    other = views[1] if home is views[0] else views[0]
    _report(home, running=256, waiting=30)
    _report(other, running=100)
    d = router.pick(views, [1], "user-1")
    assert d.view is other and d.reason != "sticky"


def test_routings_just_before_a_report_stay_counted() -> None:
    """The report may not include what was routed in its last moments: those stay pending."""
    (view,) = _views(1)
    t = time.monotonic()
    view.note_routed([], t - 1.0, new_pages=4)
    view.note_routed([], t, new_pages=2)
    _report(view, running=1, now=t + 0.01)  # a report right after: the second may be missing
    assert (view.routed_since_report, view.routed_pages_since_report) == (1, 2)
    assert view.routed_in_interval == 0 and view.traffic.last_arrivals == 0
    _report(view, running=2, now=t + 1.0)
    assert (view.routed_since_report, view.routed_pages_since_report) == (0, 0)


def _new_prompts(n: int) -> list[list[int]]:
    """Prompts of 300 tokens with distinct first 256 (their anchor), no shared prefix."""
    return [[7000 + 300 * k + i for i in range(300)] for k in range(n)]


def test_gateways_place_a_new_prefix_on_the_same_engine_without_talking() -> None:
    """Each gateway has its own views and predictions; a new prefix still goes where its anchor
    page hashes, so the requests of a group that reach different gateways at once share a cache."""
    gateway_a, gateway_b = _views(3), _views(3)
    router_a, router_b = Router("cache_aware"), Router("cache_aware")
    homes = []
    for prompt in _new_prompts(12):
        a = router_a.pick(gateway_a, prompt).view.address
        b = router_b.pick(gateway_b, prompt[:256] + [1, 2, 3, 4]).view.address  # same anchor
        assert a == b
        homes.append(a)
    assert len(set(homes)) >= 2  # different prefixes spread


def test_a_new_prefix_leaves_its_hash_home_once_that_is_fuller_by_the_threshold() -> None:
    views = _views(2)
    prompt = _new_prompts(1)[0]
    home = Router("cache_aware").pick(_views(2), prompt).view.address
    idx = int(home.split(".")[3].split(":")[0])
    _report(views[1 - idx], running=0)
    _report(views[idx], running=5)  # 5 requests fuller: within the threshold of 8
    assert Router("cache_aware").pick(views, prompt).view is views[idx]
    views = _views(2)
    _report(views[1 - idx], running=0)
    _report(views[idx], running=20)  # 20: past it
    assert Router("cache_aware").pick(views, prompt).view is views[1 - idx]
