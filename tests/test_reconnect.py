"""minisgl_core.reconnect: the stream-reopen delays and the channel options every client uses."""

from __future__ import annotations

from minisgl_core.reconnect import MAX_BACKOFF_MS, RECONNECT_OPTIONS, Backoff
from minisgl_core.serving import GRPC_OPTIONS


def test_backoff_grows_to_its_cap_with_jitter_and_resets() -> None:
    backoff = Backoff(initial=0.05, cap=1.0)
    delays = [backoff.next() for _ in range(12)]
    assert 0.025 <= delays[0] <= 0.05
    assert all(0.5 <= d <= 1.0 for d in delays[6:])  # 0.05 * 2**5 > 1: capped from the 6th on
    assert len(set(delays[6:])) > 1  # jittered, not a fixed beat
    backoff.reset()
    assert backoff.next() <= 0.05


def test_every_channel_reconnects_within_a_second() -> None:
    options = dict(GRPC_OPTIONS)
    for key, value in RECONNECT_OPTIONS:
        assert options[key] == value
    assert options["grpc.max_reconnect_backoff_ms"] == MAX_BACKOFF_MS <= 1_000
