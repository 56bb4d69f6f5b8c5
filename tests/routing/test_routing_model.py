"""bench/routing_model.py drives the real Router in a closed loop over modelled engines: every
request finishes, and with prefixes that outgrow one engine's KV cache, cache-aware routing keeps
a higher hit rate than round robin and spreads the requests over both engines."""

from __future__ import annotations

from bench.routing_model import Model, simulate

SMALL = Model(groups=16, per_group=8, system=256, question=16, output=16, slots=16, pages=224,
              page_size=16, budget=1024, concurrency=32)


def test_the_model_runs_every_request_and_cache_aware_beats_round_robin_on_hits() -> None:
    rr = simulate(SMALL, "round_robin", 8, seed=1)
    ca = simulate(SMALL, "cache_aware", 8, seed=1)
    for r in (rr, ca):
        assert r["requests"] == 16 * 8
        assert sum(r["engine_requests"]) == 16 * 8  # type: ignore[arg-type]
    assert ca["hit_rate"] > rr["hit_rate"] + 0.1  # type: ignore[operator]
    assert min(ca["engine_requests"]) > 32  # type: ignore[type-var]
