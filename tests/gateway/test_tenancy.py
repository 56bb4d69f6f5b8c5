"""Per-key quotas, fair sharing and the TTFT-SLO check, as units (a fake clock), plus the 429
they raise as both protocols send it."""

from __future__ import annotations

import pytest
from minisgl_core.proto.minisgl.v1 import scheduler_pb2
from minisgl_gateway.config import TenantLimits
from minisgl_gateway.errors import ApiError
from minisgl_gateway.slo import FirstTokenRate, check_ttft, queued_ahead
from minisgl_gateway.tenancy import Tenancy, tenant_of
from minisgl_gateway.upstream.engine_view import EngineView


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(**kw: object) -> tuple[Tenancy, Clock]:
    clock = Clock()
    return Tenancy(TenantLimits(**kw), clock), clock  # type: ignore[arg-type]


def test_tenant_ids_hash_the_key() -> None:
    a, b = tenant_of("Bearer key-a"), tenant_of("Bearer key-b")
    assert a and b and a != b and a == tenant_of("bearer  key-a ")
    assert tenant_of(None) == tenant_of("") == 0
    assert a < 2**64


def test_off_by_default_counts_nothing() -> None:
    t, _ = make()
    assert not t.enabled
    for _ in range(1000):
        t.admit(1, 0, 1, 1)
    assert not t.keys


def test_in_flight_quota_is_per_key_and_frees_on_release() -> None:
    t, _ = make(key_max_in_flight=2)
    t.admit(1, 0, 100, 3)
    t.admit(1, 1, 100, 3)
    with pytest.raises(ApiError) as err:
        t.admit(1, 2, 100, 3)
    assert err.value.status == 429 and err.value.retry_after == 3
    assert err.value.headers() == {"Retry-After": "3"}
    assert err.value.body()["error"]["type"] == "rate_limit_error"
    assert err.value.body()["error"]["code"] == "rate_limit_exceeded"
    t.admit(2, 2, 100, 3)  # another key is not affected
    t.release(1)
    t.admit(1, 2, 100, 3)


def test_tokens_per_minute_bucket_refuses_then_refills() -> None:
    t, clock = make(key_tokens_per_minute=600)  # 10 tokens a second
    t.admit(1, 0, 100, 1)
    t.release(1)
    t.charge(1, 700)  # overdrawn by 100 tokens
    with pytest.raises(ApiError) as err:
        t.admit(1, 0, 100, 1)
    assert err.value.status == 429
    assert err.value.retry_after == 11  # (100 + 1) tokens at 10 per second
    t.admit(2, 0, 100, 1)  # another key has its own bucket
    clock.now += 5
    with pytest.raises(ApiError):
        t.admit(1, 0, 100, 1)
    clock.now += 6
    t.admit(1, 0, 100, 1)  # refilled past zero
    clock.now += 3600
    t.charge(1, 1)
    assert t.keys[1].tokens == 599  # the bucket caps at one minute's worth


def test_fair_share_refuses_a_flooding_key_and_keeps_room_for_others() -> None:
    t, clock = make(key_fair_share=True)
    limit = 8

    def active() -> int:
        return sum(s.in_flight for s in t.keys.values())

    for _ in range(limit):  # alone, a key may use every slot
        t.admit(1, active(), limit, 1)
    t.seen(2)  # key 2 was refused by the global limit: it competes from now on
    # Each slot key 1 gives back goes to key 2 until both hold their share (4).
    for _ in range(4):
        t.release(1)
        with pytest.raises(ApiError) as err:
            t.admit(1, active(), limit, 1)
        assert err.value.status == 429 and err.value.retry_after == 1
        t.admit(2, active(), limit, 1)
    assert (t.keys[1].in_flight, t.keys[2].in_flight) == (4, 4)
    t.release(1)
    t.admit(1, active(), limit, 1)  # below its share again
    # Key 2 holds 1 of its 4: three free slots stay kept for it, none for key 1.
    for _ in range(3):
        t.release(2)
    assert active() == 5
    with pytest.raises(ApiError):
        t.admit(1, active(), limit, 1)
    # Once key 2 has been idle a while, key 1 may take it too.
    t.release(2)
    clock.now += 60
    while active() < limit:
        t.admit(1, active(), limit, 1)
    assert t.keys[1].in_flight == limit


def test_ttft_check() -> None:
    check_ttft(0, 100, 1.0)  # off
    check_ttft(500, 0, 1.0)  # nothing queued
    check_ttft(500, 10, 0.0)  # no evidence
    check_ttft(1000, 10, 20.0)  # 500 ms
    with pytest.raises(ApiError) as err:
        check_ttft(1000, 60, 20.0)  # 3 s
    assert err.value.status == 503 and err.value.retry_after == 2
    assert err.value.headers() == {"Retry-After": "2"}


def test_first_token_rate_and_queue_from_the_watch_load() -> None:
    rate = FirstTokenRate()
    assert rate.rate(0.0) == 0.0
    for i in range(20):
        rate.record(10.0 + i * 0.1)
    assert rate.rate(12.0) == pytest.approx(10.0)
    assert rate.rate(100.0) == 0.0  # all older than the window
    idle = EngineView("a", load=scheduler_pb2.EngineLoad(running_requests=1,
                                                        max_running_requests=4))
    busy = EngineView("b", load=scheduler_pb2.EngineLoad(running_requests=4, waiting_requests=7,
                                                        max_running_requests=4))
    assert queued_ahead([busy]) == 7
    assert queued_ahead([busy, idle]) == 0
    assert queued_ahead([]) is None


def test_gateway_reserve_applies_the_slo_and_the_key_quota() -> None:
    import asyncio
    import time
    from types import SimpleNamespace

    from minisgl_gateway.config import parse_config
    from minisgl_gateway.gateway import Gateway

    async def main() -> None:
        gw = Gateway(parse_config(["--ttft-slo-ms", "500", "--key-max-in-flight", "1"]))
        view = EngineView("a", up=True, load=scheduler_pb2.EngineLoad(
            running_requests=4, waiting_requests=30, max_running_requests=4))
        gw.pipeline.links = {"a": SimpleNamespace(view=view)}  # type: ignore[dict-item]
        tenant = gw.tenant("Bearer k")
        assert tenant == tenant_of("Bearer k")
        with gw.reserve(tenant):  # no first token seen yet: no evidence, admitted
            with pytest.raises(ApiError) as err:
                gw.reserve(tenant)
            assert err.value.status == 429
        now = time.monotonic()
        for i in range(20):  # 20 first tokens over the last 2 s: 10 a second
            gw.first_tokens.record(now - 2 + i * 0.1)
        with pytest.raises(ApiError) as err:
            gw.reserve(tenant)  # 30 queued at 10 a second: about 3 s
        assert err.value.status == 503 and err.value.code == "slo_unattainable"
        assert err.value.retry_after is not None and err.value.retry_after >= 2
        assert gw.active == 0 and gw.tenancy.keys[tenant].in_flight == 0
        view.load.waiting_requests = 3  # 300 ms: within the target
        with gw.reserve(tenant):
            assert gw.active == 1
        gw.pipeline.links = {}
        await gw.close()

    asyncio.run(main())
