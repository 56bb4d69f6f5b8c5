"""The routing policies over hand-made engine views (no I/O): cache_aware follows the longest
cached or predicted prefix until the load gap passes the threshold, least_load and round_robin
spread, sticky sessions keep their engine and move only when it leaves, and a view applies Watch
messages in order and asks for a resync on a gap."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

from minisgl_core.prefix_hash import page_hashes
from minisgl_core.proto.minisgl.v1 import scheduler_pb2
from minisgl_gateway.upstream.discovery import Discovery
from minisgl_gateway.upstream.engine_view import EngineView
from minisgl_gateway.upstream.routing import Router

PS = 4


def _views(n: int) -> list[EngineView]:
    views = []
    for i in range(n):
        v = EngineView(f"10.0.0.{i}:1", page_size=PS, up=True)
        views.append(v)
    return views


def _load(v: EngineView, running: int) -> None:
    v.apply(scheduler_pb2.WatchResponse(seq=v.seq, load=scheduler_pb2.EngineLoad(
        running_requests=running, total_pages=100)))


def test_cache_aware_prefers_the_longest_cached_prefix_until_overloaded() -> None:
    views = _views(3)
    prompt = list(range(40))
    hashes = page_hashes(prompt, PS)
    views[1].index = set(hashes[:3])
    views[2].index = set(hashes[:6])
    router = Router("cache_aware", balance_threshold=4)
    d = router.pick(views, prompt)
    assert d.view is views[2] and d.reason == "cache" and d.predicted_tokens == 6 * PS
    _load(views[2], 10)  # 10 more requests than the idle engines: past the threshold
    d = router.pick(views, prompt)
    assert d.view is not views[2] and d.reason == "load"
    assert d.predicted_tokens == (3 * PS if d.view is views[1] else 0)


def test_a_burst_of_one_new_prefix_stays_on_one_engine() -> None:
    """Before the scheduler reports the prefix, the router's prediction holds it together."""
    views = _views(3)
    router = Router("cache_aware", balance_threshold=8)
    system = list(range(100, 164))
    picks = Counter(router.pick(views, system + [i] * PS).view.address for i in range(6))
    assert len(picks) == 1
    # Another prefix goes to a less loaded engine.
    other = router.pick(views, list(range(500, 564))).view.address
    assert other not in picks


def test_least_load_and_round_robin_spread() -> None:
    views = _views(3)
    _load(views[0], 5)
    _load(views[1], 1)
    _load(views[2], 3)
    assert Router("least_load").pick(views, [1] * 8).view is views[1]
    rr = Router("round_robin")
    assert [rr.pick(views, [1] * 8).view for _ in range(6)] == views * 2


def test_sticky_sessions_keep_their_engine_and_move_only_when_it_leaves() -> None:
    views = _views(4)
    router = Router("least_load", balance_threshold=100, sticky=True)
    homes = {f"user-{k}": router.pick(views, [1], f"user-{k}").view for k in range(40)}
    assert len(set(h.address for h in homes.values())) == 4
    for session, home in homes.items():
        assert router.pick(views, [2], session).view is home
    gone = views[0]
    rest = views[1:]
    for session, home in homes.items():
        now = router.pick(rest, [3], session).view
        assert (now is home) == (home is not gone)


def test_view_applies_events_and_detects_gaps() -> None:
    v = EngineView("a:1")
    assert v.apply(scheduler_pb2.WatchResponse(seq=5, snapshot=True, stored=[1, 2], page_size=PS))
    assert v.index == {1, 2} and v.seq == 5 and v.page_size == PS
    assert v.apply(scheduler_pb2.WatchResponse(seq=6, stored=[3], removed=[1]))
    assert v.index == {2, 3}
    assert not v.apply(scheduler_pb2.WatchResponse(seq=8, stored=[4]))  # 7 is missing
    assert v.index == {2, 3} and v.seq == 6
    # A load-only message carries no batch: no gap check.
    assert v.apply(scheduler_pb2.WatchResponse(seq=6, load=scheduler_pb2.EngineLoad(
        draining=True)))
    assert v.draining


def test_discovery_static_and_file(tmp_path: Path) -> None:
    assert Discovery("a:1, b:2,a:1").static() == ["a:1", "b:2"]
    assert not Discovery("a:1").dynamic
    path = tmp_path / "engines"
    path.write_text("x:1\n# a comment\ny:2, z:3\n")
    found = asyncio.run(Discovery(f"file://{path}").resolve())
    assert found == ["x:1", "y:2", "z:3"]
    assert asyncio.run(Discovery(f"file://{tmp_path}/missing").resolve()) is None
    assert asyncio.run(Discovery("dns:///localhost:7").resolve()) in (
        ["127.0.0.1:7"], ["127.0.0.1:7", "[::1]:7"], ["[::1]:7", "127.0.0.1:7"])


def _report(v: EngineView, running: int, waiting: int = 0, cap: int = 8,
            watchers: int = 1) -> None:
    v.apply(scheduler_pb2.WatchResponse(seq=v.seq, load=scheduler_pb2.EngineLoad(
        running_requests=running, waiting_requests=waiting, total_pages=100,
        max_running_requests=cap, watchers=watchers)))


def test_room_counts_the_other_gateways_and_a_reported_queue() -> None:
    v = _views(1)[0]
    assert v.room is None  # an engine that does not report its limit
    _report(v, running=3, watchers=2)
    assert v.room == 5
    v.note_routed(())  # this gateway's one since the report, and presumably the other's one
    assert v.room == 3
    _report(v, running=8, waiting=2)
    assert v.room == -2  # already queueing: whatever comes next waits behind those


def test_cache_aware_leaves_a_full_engine_for_one_with_room() -> None:
    prompt = list(range(40))
    hashes = page_hashes(prompt, PS)

    def engines(home_waiting: int = 0, others_full: bool = False) -> list[EngineView]:
        views = _views(3)
        views[0].index = set(hashes)
        views[1].index = set(hashes[:2])
        _report(views[0], running=8, waiting=home_waiting)  # at its limit: a new one waits
        _report(views[1], running=8 if others_full else 6)
        _report(views[2], running=8 if others_full else 2, waiting=3 if others_full else 0)
        return views

    views = engines()
    d = Router("cache_aware", balance_threshold=32, queue_slack=0).pick(views, prompt)
    # Among the engines with room, the one with the longest prefix.
    assert d.view is views[1] and d.reason == "room" and d.predicted_tokens == 2 * PS
    # Slack lets that many wait where the prefix is; -1 never leaves it.
    views = engines(home_waiting=1)
    assert Router("cache_aware", queue_slack=2).pick(views, prompt).view is views[0]
    assert Router("cache_aware", queue_slack=-1).pick(views, prompt).view is views[0]
    assert Router("cache_aware", queue_slack=1).pick(views, prompt).view is views[1]
    # The default lets 4 wait there (a fifth would leave).
    assert Router("cache_aware").pick(engines(home_waiting=3), prompt).view.address.endswith("0:1")
    assert Router("cache_aware").pick(engines(home_waiting=4), prompt).reason == "room"
    # Every engine full: queue where the prefix is.
    views = engines(others_full=True)
    d = Router("cache_aware").pick(views, prompt)
    assert d.view is views[0] and d.reason == "cache"


def test_a_burst_on_one_prefix_fills_its_engine_then_spills() -> None:
    """Between reports a gateway counts what it routed, times the gateways watching: a burst of
    one group fills its engine's free slots (as this gateway's share of them) and the rest go to
    the engine with room, where the prefix is then predicted too."""
    views = _views(2)
    for v in views:
        _report(v, running=0, cap=8, watchers=2)
    router = Router("cache_aware", balance_threshold=32, queue_slack=0)
    system = list(range(100, 164))
    picks = [router.pick(views, system + [i] * PS) for i in range(8)]
    first = picks[0].view
    assert [p.view is first for p in picks] == [True] * 4 + [False] * 4
    assert {p.reason for p in picks[5:]} == {"cache"}  # the spilled copy is followed too


def test_cache_aware_matches_only_pages_of_the_same_salt() -> None:
    """The scheduler names salted pages by hashes chained from the salt's seed: the router hashes
    a salted prompt the same way, so it predicts hits within a salt and none across salts."""
    from minisgl_core.prefix_hash import salt_seed

    views = _views(2)
    prompt = list(range(40))
    views[1].index = set(page_hashes(prompt, PS, salt_seed("a")))
    router = Router("cache_aware", balance_threshold=4)
    d = router.pick(views, prompt, cache_salt="a")
    assert d.view is views[1] and d.reason == "cache" and d.predicted_tokens == 10 * PS
    for salt in ("b", ""):
        d = router.pick(views, prompt, cache_salt=salt)
        assert d.reason == "load" and d.predicted_tokens == 0
