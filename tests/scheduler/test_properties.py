"""Random sequences of submit / step / abort / evict against the fake GPU, overlap on and off.

After every operation: every page is in exactly one place (free, a request's own, or the radix
tree), ref counts (and, with a window pool, window-lock counts) equal the locks requests and
pending holds have, slots are not shared. At the end: every output is
exactly what an unbatched, uncached run produces (or a prefix of it for aborted requests), and
free pages + evictable cached pages == pool size.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from minisgl_core.sampling import SamplingParams
from minisgl_scheduler import ErrorCode, FinishReason, Scheduler, SchedulerConfig, SchedulerError

from .fake_executor import FakeExecutor, reference
from .helpers import Recorder, assert_all_pages_back, run

# A few shared prefixes so the radix cache gets hits, splits and evictions.
BASES = [[7] * 24, [7] * 8 + [9] * 16, list(range(100, 124))]


@st.composite
def _prompt(draw: st.DrawFn) -> tuple[list[int], SamplingParams]:
    base = draw(st.sampled_from(BASES))
    prompt = base[: draw(st.integers(0, 24))] + draw(st.lists(st.integers(0, 999), max_size=10))
    max_tokens = draw(st.integers(1, 12))
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, min_tokens=draw(st.integers(0, 3)) % (max_tokens + 1),
        ignore_eos=draw(st.booleans()),
    )
    return prompt, params


PROMPT = _prompt()


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        overlap=st.booleans(),
        cache=st.sampled_from(["radix", "naive"]),
        policy=st.sampled_from(["fcfs", "lpm"]),
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(12, 48),
        budget=st.sampled_from([3, 16, 64]),
        eos_every=st.sampled_from([0, 5]),
        reserve=st.sampled_from([0.0, 0.5]),
        window=st.sampled_from([0, 0, 1, 3, 8]),
        data=st.data(),
    )
    def setup(self, overlap: bool, cache: str, policy: str, page_size: int, num_pages: int,
              budget: int, eos_every: int, reserve: float, window: int,
              data: st.DataObject) -> None:
        self._setup(overlap, cache, policy, page_size, num_pages, budget, eos_every, reserve,
                    window, data)

    def _setup(self, overlap: bool, cache: str, policy: str, page_size: int, num_pages: int,
               budget: int, eos_every: int, reserve: float, window: int,
               data: st.DataObject) -> None:
        # A sliding-window pool from the fewest pages one request needs to make progress (its
        # window and the page it writes) up to the full pool's size.
        least = -(-window // page_size) + 1
        window_pages = data.draw(st.integers(least, max(least, num_pages))) if window else 0
        self.fake = FakeExecutor(num_pages=num_pages, page_size=page_size, max_slots=6,
                                 max_model_len=48 * page_size, eos_every=eos_every,
                                 window_pages=window_pages, window=window)
        self.sched = Scheduler(self.fake, SchedulerConfig(
            disable_overlap=not overlap, cache=cache, policy=policy,  # type: ignore[arg-type]
            max_prefill_tokens=budget, max_running_requests=5, max_queued_requests=8,
            decode_reserve_ratio=reserve))
        self.rec = Recorder()
        self.prompts: dict[int, tuple[list[int], SamplingParams]] = {}
        self.aborted: set[int] = set()
        self.next_rid = 0
        self.capacity = num_pages * page_size
        self.failures = False

    @rule(batch=st.lists(PROMPT, min_size=1, max_size=4))
    def submit(self, batch: list[tuple[list[int], SamplingParams]]) -> None:
        for prompt, params in batch:
            if not prompt:
                continue
            rid = self.next_rid
            try:
                self.sched.submit(rid, prompt, params)
            except SchedulerError as exc:
                # Only the queue bound and the pool size may refuse these prompts.
                assert len(self.sched.waiting) >= 8 or len(prompt) > self.capacity, exc
                continue
            self.next_rid += 1
            self.prompts[rid] = (prompt, params)

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        for _ in range(n):
            self.rec.add(self.sched.step())
            self.sched.check_invariants()

    @precondition(lambda self: bool(self.sched.reqs))
    @rule(data=st.data(), stop=st.booleans())
    def abort(self, data: st.DataObject, stop: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.reqs)))
        reason = FinishReason.STOP if stop else FinishReason.ABORT
        assert self.sched.abort(rid, reason)
        assert not self.sched.abort(rid)  # already ended
        self.aborted.add(rid)

    @rule(n=st.integers(1, 8))
    def evict(self, n: int) -> None:
        kv = self.sched.kv
        if kv.cache is not None:
            dropped: list[int] = []
            kv.allocator.free(kv.cache.evict(n, dropped))
            if kv.windowed:
                kv._free_win(dropped + kv.cache.evict_window(n))

    @rule(n=st.integers(1, 8))
    def evict_window_pages(self, n: int) -> None:
        """Window pages alone (LRU), possibly of nodes running requests hold but no longer read
        from: later hits through them are cut, and no page a query reads may go."""
        kv = self.sched.kv
        if kv.cache is not None and kv.windowed:
            kv._free_win(kv.cache.evict_window(n))

    @rule(dice=st.integers(0, 7))
    def worker_fails_next_step(self, dice: int) -> None:
        if dice == 0:  # rare: a failure ends every running request
            self.fake.fail_steps.add(self.sched._next_step)
            self.failures = True

    @invariant()
    def pages_accounted(self) -> None:
        if hasattr(self, "sched"):
            self.sched.check_invariants()

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        run(self.sched, self.rec)
        assert_all_pages_back(self.sched)
        st_ = self.sched.stats()
        event(f"preempted: {st_.preemptions > 0}")
        event(f"prefix hits: {st_.prefix_hit_tokens > 0}")
        event(f"worker failed: {self.failures}")
        event(f"window reads: {self.fake.window_reads > 0}")
        if self.fake.window_reads:
            event(f"windowed prefix hits: {st_.prefix_hit_tokens > 0}")
        event(f"requests: {min(len(self.prompts), 10) // 5 * 5}+")
        for rid, (prompt, params) in self.prompts.items():
            out = self.rec.out[rid]
            want = reference(prompt, params, self.fake)
            assert out.finish is not None, rid
            if rid in self.aborted:
                assert out.tokens == want[: len(out.tokens)]
                assert out.finish in (FinishReason.ABORT, FinishReason.STOP)
            elif out.error is not None and out.error.code is ErrorCode.UNAVAILABLE:
                assert self.failures and "injected failure" in out.error.message
                assert out.tokens == want[: len(out.tokens)]
            elif out.error is not None:
                # Only a request that cannot fit in the whole pool may fail, with a clear error.
                assert out.error.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED, out.error
                assert len(prompt) + len(want) - 1 > self.capacity
                assert out.tokens == want[: len(out.tokens)]
            else:
                assert out.error is None, out.error
                assert out.tokens == want, (rid, out.tokens, want)
                eos = out.tokens[-1] in self.fake.info().eos_token_ids
                assert out.finish is (FinishReason.STOP if eos and not params.ignore_eos
                                      else FinishReason.LENGTH)
        assert self.fake.max_inflight_seen <= (1 if self.sched.config.disable_overlap else 2)


class WindowedMachine(SchedulerMachine):
    """Always a window pool and a radix cache: shared prefixes longer than the window, window
    pages left cached as windows move on, LRU window eviction, holds under overlap."""

    @initialize(
        overlap=st.booleans(),
        policy=st.sampled_from(["fcfs", "lpm"]),
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(16, 48),
        budget=st.sampled_from([3, 8, 64]),
        eos_every=st.sampled_from([0, 5]),
        reserve=st.sampled_from([0.0, 0.5]),
        window=st.sampled_from([2, 3, 5, 8]),
        data=st.data(),
    )
    def setup(self, overlap: bool, policy: str, page_size: int, num_pages: int, budget: int,
              eos_every: int, reserve: float, window: int, data: st.DataObject) -> None:
        self._setup(overlap, "radix", policy, page_size, num_pages, budget, eos_every, reserve,
                    window, data)


SETTINGS = settings(
    max_examples=int(os.environ.get("SCHED_EXAMPLES", 250)), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = SETTINGS
TestWindowed = WindowedMachine.TestCase
TestWindowed.settings = SETTINGS
