"""The sliding-window pool in the scheduler, against the fake worker's window checks: window pages
drop out as a sequence grows (never one a later query reads), prefix hits are cut to what windowed
layers can use, and every window page comes back after preemption, abort and the end."""

from __future__ import annotations

from minisgl_core.sampling import SamplingParams
from minisgl_scheduler import Scheduler, SchedulerConfig
from minisgl_scheduler.kv_window import first_visible_page, usable_pages

from .fake_executor import FakeExecutor, reference
from .helpers import Recorder, assert_all_pages_back, run

PS, WINDOW = 4, 10


def _sched(window_pages: int, num_pages: int = 128, overlap: bool = True, budget: int = 8,
           **kw: object) -> tuple[FakeExecutor, Scheduler]:
    fake = FakeExecutor(num_pages=num_pages, page_size=PS, max_slots=4, max_model_len=4096,
                        window_pages=window_pages, window=WINDOW)
    return fake, Scheduler(fake, SchedulerConfig(disable_overlap=not overlap,
                                                 max_prefill_tokens=budget, **kw))  # type: ignore[arg-type]


def test_window_arithmetic() -> None:
    assert first_visible_page(9, 10, 4) == 0  # sees positions 0..9
    assert first_visible_page(13, 10, 4) == 1  # sees 4..13
    assert usable_pages([-1, -1, 5, 6, 7], 4, 10) == 5  # a query at 20 reads 11..19: pages 2-4
    assert usable_pages([-1, -1, 5, -1, 7], 4, 10) == 0
    assert usable_pages([3, 4, -1], 4, 10) == 2


def test_long_sequence_drops_window_pages_and_matches_reference() -> None:
    for overlap in (True, False):
        # 12 window pages for a 200+ token sequence: only trimming keeps it going.
        fake, sched = _sched(window_pages=12, overlap=overlap)
        prompt = list(range(50, 150))
        params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        sched.submit(1, prompt, params)
        rec, most = Recorder(), 0
        while sched.has_work():
            rec.add(sched.step())
            sched.check_invariants()
            req = sched.reqs.get(1)
            if req is not None:
                held = sum(p >= 0 for p in req.win)
                most = max(most, held)
                assert held <= -(-(WINDOW + 8) // PS) + 2, held  # a window and a chunk
        assert rec.out[1].tokens == reference(prompt, params, fake)
        assert fake.window_reads > 1000  # the fake checked every cached window position
        assert most < 220 // PS
        assert_all_pages_back(sched)


def test_prefix_hit_needs_the_window_pages() -> None:
    fake, sched = _sched(window_pages=40)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = list(range(200, 240))
    sched.submit(1, prompt, params)
    run(sched)
    # The first request's pages are cached, window pages included: those its window moved past
    # stayed in the tree as cache (the pool had room), not only its last window.
    kv = sched.kv
    assert kv.cache is not None
    found = kv.cache.match(prompt + [1])
    assert found.num_pages == 10 and found.win is not None
    assert all(p >= 0 for p in found.win)
    assert kv.cache.evictable_win == kv.window_pages - kv.win_alloc.num_free  # type: ignore[union-attr]
    # A continuation (multi-turn) hits the whole cached prefix: its last window is there.
    turn2 = prompt + reference(prompt, params, fake) + [7, 8, 9]
    rec = Recorder()
    sched.submit(2, turn2, params)
    run(sched, rec)
    assert rec.out[2].cached_tokens >= 40
    assert rec.out[2].tokens == reference(turn2, params, fake)
    # A prompt that shares only the early part hits it too: its window pages were kept.
    other = prompt[:20] + [5] * 20
    sched.submit(3, other, params)
    run(sched, rec)
    assert rec.out[3].cached_tokens == 20
    assert rec.out[3].tokens == reference(other, params, fake)
    # Once those window pages are evicted (LRU: the early part, unused since, goes first), the
    # same kind of prompt is cut back to nothing usable and computed afresh, correctly.
    early = kv.cache.match(prompt[:24]).win
    assert early is not None
    kv._free_win(kv.cache.evict_window(kv.cache.evictable_win))
    other2 = prompt[:24] + [6] * 20
    sched.submit(4, other2, params)
    run(sched, rec)
    assert rec.out[4].cached_tokens == 0
    assert rec.out[4].tokens == reference(other2, params, fake)
    assert_all_pages_back(sched)


def test_shared_prefix_longer_than_the_window_hits_while_the_first_runs() -> None:
    """Requests sharing a system prompt longer than the window, arriving one after another while
    the first still decodes: the window pages at the end of the shared prefix, which the first
    request's window has moved past, stay in the tree and every later request hits them."""
    for overlap in (True, False):
        fake, sched = _sched(window_pages=60, overlap=overlap)
        system = list(range(400, 440))  # 40 tokens: four windows of 10
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        rec = Recorder()
        prompts = {rid: system + [rid, rid + 1, rid + 2] for rid in range(1, 5)}
        for rid, p in prompts.items():
            sched.submit(rid, p, params)
            for _ in range(8):  # it prefills and decodes past the shared prefix
                rec.add(sched.step())
                sched.check_invariants()
        run(sched, rec)
        for rid, p in prompts.items():
            assert rec.out[rid].tokens == reference(p, params, fake), rid
            assert rec.out[rid].cached_tokens == (0 if rid == 1 else 40), rid
        assert_all_pages_back(sched)


def test_window_lock_passes_to_a_hold_until_the_step_is_collected() -> None:
    """Tree window pages a request's window moves past while a launched step may still read
    them are not evictable until that step is collected."""
    fake, sched = _sched(window_pages=40, budget=64)
    kv = sched.kv
    assert kv.cache is not None
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    sched.submit(1, list(range(500, 540)), params)
    sched.step()  # prefill launched (overlap: in flight), its 10 pages inserted and locked
    req = sched.reqs[1]
    assert req.shared_pages == 10 and kv.cache.evictable_win == 0
    kv.trim(req, 40, until_step=sched._last_launched())
    assert req.win_from == req.win_lo == first_visible_page(40, WINDOW, PS)
    assert kv.cache.evictable_win == 0 and kv.win_holds  # held for the in-flight step
    sched.check_invariants()
    kv.collected(sched._last_launched())  # type: ignore[arg-type]
    assert not kv.win_holds and kv.cache.evictable_win == req.win_lo
    sched.check_invariants()
    run(sched)
    assert_all_pages_back(sched)


def test_window_evicted_then_hit_is_cut() -> None:
    fake, sched = _sched(window_pages=40)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = list(range(300, 332))
    sched.submit(1, prompt, params)
    run(sched)
    kv = sched.kv
    assert kv.cache is not None
    kv._free_win(kv.cache.evict_window(kv.cache.evictable_win))  # window KV gone, full stays
    assert kv.cache.match(prompt).num_pages == 8
    rec = Recorder()
    sched.submit(2, prompt + [1, 2, 3], params)
    run(sched, rec)
    assert rec.out[2].cached_tokens == 0  # full-attention KV alone is not enough
    assert rec.out[2].tokens == reference(prompt + [1, 2, 3], params, fake)
    assert_all_pages_back(sched)


def test_preemption_and_abort_give_every_window_page_back() -> None:
    # A small full pool forces preemption; aborts land mid-prefill and mid-decode.
    fake, sched = _sched(window_pages=14, num_pages=30, budget=6)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = {rid: [rid] * 5 + list(range(rid * 10, rid * 10 + 25)) for rid in range(1, 6)}
    for rid, p in prompts.items():
        sched.submit(rid, p, params)
    rec = Recorder()
    for i in range(400):
        if not sched.has_work():
            break
        rec.add(sched.step())
        sched.check_invariants()
        if i == 3:
            sched.abort(2)
        if i == 12:
            sched.abort(4)
    assert sched.stats().preemptions > 0
    for rid, p in prompts.items():
        want = reference(p, params, fake)
        got = rec.out[rid].tokens
        assert got == (want[:len(got)] if rid in (2, 4) else want), rid
    assert_all_pages_back(sched)


def test_no_window_pool_sends_no_window_pages() -> None:
    fake = FakeExecutor(num_pages=64, page_size=PS)
    sched = Scheduler(fake, SchedulerConfig())
    sched.submit(1, list(range(40)), SamplingParams(temperature=0.0, max_tokens=8))
    run(sched)
    assert not sched.kv.windowed
    for plan in fake.plans:
        assert not plan.decodes.new_window_pages
        assert all(not r.new_window_pages for r in plan.reqs)
