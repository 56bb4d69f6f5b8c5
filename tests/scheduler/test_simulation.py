"""Whole workloads over the fake GPU: memory pressure, shared prefixes, overlap on/off."""

from __future__ import annotations

import random

import pytest
from minisgl_core.sampling import SamplingParams
from minisgl_scheduler import FinishReason, Scheduler, SchedulerConfig

from .fake_executor import FakeExecutor, reference
from .helpers import assert_all_pages_back, run


def test_thousand_requests_in_a_pool_too_small_for_them() -> None:
    """1,000 requests, random lengths; the pool holds a small fraction of them at once.

    Each gets exactly its max_tokens (ignore_eos), identical to an unbatched run, and the scheduler
    had to preempt (and recompute) requests to get there."""
    rng = random.Random(1234)
    fake = FakeExecutor(num_pages=160, page_size=4, max_slots=64, max_model_len=1024,
                        paranoid=False)
    sched = Scheduler(fake, SchedulerConfig(max_prefill_tokens=512, max_queued_requests=1000))
    work = {}
    for rid in range(1000):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 200))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 120), ignore_eos=True)
        work[rid] = (prompt, params)
        sched.submit(rid, prompt, params)
    demand = sum(len(p) + sp.max_tokens for p, sp in work.values())
    assert demand > 50 * 160 * 4  # the pool holds under 2% of the total demand
    rec = run(sched, check=False)
    for rid, (prompt, params) in work.items():
        out = rec.out[rid]
        assert out.finish is FinishReason.LENGTH and out.error is None
        assert len(out.tokens) == params.max_tokens
        assert out.tokens == reference(prompt, params, fake)
    stats = sched.stats()
    assert stats.preemptions > 0
    assert stats.finished == 1000
    assert_all_pages_back(sched)


@pytest.mark.parametrize("overlap", [True, False])
def test_preemption_under_pressure_with_invariants(overlap: bool) -> None:
    """A smaller, fully checked version: invariants after every step, every chain re-verified."""
    rng = random.Random(7)
    fake = FakeExecutor(num_pages=24, page_size=2, max_slots=8, eos_every=9)
    sched = Scheduler(fake, SchedulerConfig(disable_overlap=not overlap, max_prefill_tokens=16,
                                            decode_reserve_ratio=0.0))
    work = {}
    for rid in range(60):
        prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 24))
        work[rid] = (prompt, params)
        sched.submit(rid, prompt, params)
    rec = run(sched)
    for rid, (prompt, params) in work.items():
        assert rec.out[rid].tokens == reference(prompt, params, fake)
    assert sched.stats().preemptions > 0
    assert_all_pages_back(sched)


def _shared_prefix_run(cache: str, overlap: bool, budget: int) -> tuple[dict, Scheduler]:
    rng = random.Random(99)
    system = [rng.randrange(1000) for _ in range(512)]
    fake = FakeExecutor(num_pages=512, page_size=16, max_slots=64, max_model_len=2048,
                        paranoid=False)
    sched = Scheduler(fake, SchedulerConfig(cache=cache, disable_overlap=not overlap,  # type: ignore[arg-type]
                                            max_prefill_tokens=budget, max_running_requests=64))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    for rid in range(64):
        sched.submit(rid, system + [rng.randrange(1000) for _ in range(16)], params)
    rec = run(sched)
    return {rid: o.tokens for rid, o in rec.out.items()}, sched


@pytest.mark.parametrize("overlap,budget", [(True, 8192), (False, 8192), (True, 200)])
def test_shared_system_prompt_is_computed_once(overlap: bool, budget: int) -> None:
    cached, sched = _shared_prefix_run("radix", overlap, budget)
    naive, naive_sched = _shared_prefix_run("naive", overlap, budget)
    assert cached == naive  # the cache changes cost, never results
    # 512 shared tokens once, then each request's own 16 tokens.
    assert sched.stats().prefill_tokens == 512 + 64 * 16
    assert naive_sched.stats().prefill_tokens == 64 * (512 + 16)
    assert sched.stats().prefix_hit_rate == pytest.approx(63 * 512 / (64 * 528))
    assert naive_sched.stats().prefix_hit_rate == 0.0
    assert_all_pages_back(sched)
    assert_all_pages_back(naive_sched)


def test_overlap_on_and_off_give_identical_greedy_outputs() -> None:
    rng = random.Random(5)
    work = [([rng.randrange(300) for _ in range(rng.randrange(1, 60))],
             SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 40)))
            for _ in range(80)]
    results = []
    for overlap in (True, False):
        fake = FakeExecutor(num_pages=96, page_size=4, max_slots=16, eos_every=13)
        sched = Scheduler(fake, SchedulerConfig(disable_overlap=not overlap,
                                                max_prefill_tokens=64))
        for rid, (prompt, params) in enumerate(work):
            sched.submit(rid, prompt, params)
        rec = run(sched)
        results.append({rid: (o.tokens, o.finish) for rid, o in rec.out.items()})
        assert fake.max_inflight_seen == (2 if overlap else 1)
        assert_all_pages_back(sched)
    assert results[0] == results[1]
    # EOS ended some requests early; with overlap their extra in-flight token was dropped.
    assert any(finish is FinishReason.STOP for _, finish in results[0].values())
