"""Continuous batching over a `StepExecutor`: requests in, one planned step at a time, tokens out.

Each `step()` plans a batch (every decoding request plus prefill chunks under the token budget:
`--max-prefill-tokens`, or less to meet a step-time target, pacing.py), launches it, and collects
a step's tokens. With overlap on, step N+1 is launched before step N is collected: decode entries
carry no input token (the worker feeds back what it sampled), so the plan never waits for the
previous result. Two consequences are handled here:

* a request that finished in step N may still be in step N+1: that extra token is dropped;
* a request's pages and slot are released only once no launched step references it.

When the pool cannot grow a running request, the youngest running request is preempted: its written
KV goes to the prefix cache (evictable) and it is recomputed later from prompt + outputs so far.

Priorities (vLLM's: lower values first, default 0) order the waiting queue before arrival, and
"youngest" above means lowest priority, then youngest. A waiting request that lacks a slot or pages
preempts running requests of a strictly lower priority, at most `--max-priority-preemptions` per
step: a victim never preempts back what displaced it, so there is no cycle. Within one priority,
tenants (the gateway's hash of the API key) are admitted in turn (admission.waiting_order).

Pages, slots and the prefix cache describe the KV of one worker process. When another process
answers (a restarted worker, `StepExecutor.check_worker`), all of it is dropped: running requests
fail with a clear error, waiting ones start from scratch on the new worker. `worker_up` says
whether the worker answered last time it was asked (routers skip an engine whose worker is down);
`probe_worker` asks again between iterations while the loop is idle.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from collections import deque

from minisgl_core.prefix_hash import salt_seed
from minisgl_core.sampling import SamplingParams
from minisgl_core.step import StepExecutor, StepPlan, WorkerInfo

from minisgl_scheduler.admission import (
    check_request,
    new_request,
    reserve_pages,
    resume_split,
    waiting_order,
)
from minisgl_scheduler.config import SchedulerConfig
from minisgl_scheduler.errors import (
    ErrorCode,
    InvalidRequest,
    Overloaded,
    SchedulerError,
    WorkerFailed,
)
from minisgl_scheduler.kv import KVManager, pages_for
from minisgl_scheduler.launched import LaunchedStep, check_output
from minisgl_scheduler.pacing import PrefillPacer, attention_pairs, resolve_target
from minisgl_scheduler.radix import CacheListener
from minisgl_scheduler.request import FinishReason, Phase, Request, TokenEvent, take_token
from minisgl_scheduler.request_trace import RequestTraces
from minisgl_scheduler.stats import SchedulerStats
from minisgl_scheduler.tenants import TenantTurns

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, executor: StepExecutor, config: SchedulerConfig | None = None) -> None:
        self.config = config = config or SchedulerConfig()
        config.validate()
        self.executor = executor
        # Told of every page the prefix cache stores or drops, across worker restarts (each new
        # worker process gets a new cache, which must report to the same listener).
        self._cache_listener: CacheListener | None = None
        # The worker answered the last check or step (False from a broken step stream or an
        # unreachable worker until it answers again).
        self.worker_up = True
        self._adopt(executor.info())
        self.reqs: dict[int, Request] = {}  # live (not ended) requests by rid
        self.waiting: list[Request] = []  # sorted by arrival
        self.running: list[Request] = []  # sorted by Request.rank: priority, then arrival
        self._zombies: set[Request] = set()  # ended, pages held until their steps are collected
        self.inflight: deque[LaunchedStep] = deque()
        self._events: dict[Request, TokenEvent] = {}
        self._arrivals = 0
        self.turns = TenantTurns()  # which tenant's turn it is, per priority
        # Some request had a priority other than 0: only then can one need to preempt another,
        # so the per-step scan of the queue is skipped otherwise.
        self._prioritized = False
        self._next_step = 1
        # A step failed: cached KV is suspect until every step launched before that is collected.
        self._poisoned = False
        self._poison_until = 0
        self._counters = dict(hit=0, query=0, preempt=0, prefill=0, decode=0, steps=0, done=0)
        self.traces = RequestTraces()  # spans / request ids of traced or logged requests

    def _adopt(self, info: WorkerInfo) -> None:
        """Page and slot state for a worker (at start, or a new process): all empty."""
        self.info = info
        self.page_size = info.page_size
        self.kv = KVManager(info.num_pages, info.page_size, use_cache=self.config.cache == "radix",
                            window_pages=info.window_pages, window=info.window)
        if self.kv.cache is not None:
            self.kv.cache.listener = self._cache_listener
        self.max_running = min(self.config.max_running_requests, info.max_slots)
        self.eos_ids = frozenset(info.eos_token_ids)
        self._free_slots = list(range(info.max_slots))  # a heap: lowest slot first
        self.pacer = PrefillPacer(resolve_target(self.config.max_step_ms, info.device),
                                  self.config.max_prefill_tokens)
        step = self.config.max_prefill_tokens + self.max_running
        if info.tp_size > 1 and 0 < info.two_shot_max_tokens < step:
            log.warning(
                "prefill steps of up to %d tokens (--max-prefill-tokens %d + %d running) exceed "
                "the worker's fused TP all-reduce (%d tokens): longer steps go through NCCL, "
                "slower. Start the worker with --max-prefill-tokens %d too.", step,
                self.config.max_prefill_tokens, self.max_running, info.two_shot_max_tokens,
                self.config.max_prefill_tokens)

    # -- public API ----------------------------------------------------------------------------

    @property
    def cache_listener(self) -> CacheListener | None:
        return self._cache_listener

    @cache_listener.setter
    def cache_listener(self, listener: CacheListener | None) -> None:
        """Who hears of prefix-cache changes (the Watch event log): this cache and every one a
        restarted worker brings."""
        self._cache_listener = listener
        if self.kv.cache is not None:
            self.kv.cache.listener = listener

    def submit(self, rid: int, input_ids: list[int], params: SamplingParams,
               cache_salt: str = "", num_prompt_tokens: int = 0, priority: int = 0,
               tenant: int = 0) -> None:
        """Queue a request; raises a SchedulerError subclass when it is refused. Its prompt
        shares cached prefix pages only with requests of the same `cache_salt`; lower
        `priority` values go first; `tenant` is its fair-share group (0: none).
        `num_prompt_tokens` > 0: a resumed request whose input_ids end with outputs it already
        made elsewhere; it continues as a preempted request would (see `resume_split`)."""
        if rid in self.reqs:
            raise InvalidRequest(f"request id {rid} is already in use")
        check_request(self.info, input_ids, params)
        prompt_len = resume_split(input_ids, params, num_prompt_tokens)
        if len(self.waiting) >= self.config.max_queued_requests:
            raise Overloaded(
                f"the scheduler queue is full ({len(self.waiting)} waiting requests); retry later"
            )
        self._arrivals += 1
        req = new_request(self.info, self.eos_ids, rid, input_ids, params, self._arrivals,
                          salt_seed(cache_salt), prompt_len)
        req.priority, req.tenant = priority, tenant
        self._prioritized |= priority != 0
        self.reqs[rid] = req
        self.waiting.append(req)  # the newest arrival sorts last

    def abort(self, rid: int, reason: FinishReason | str = FinishReason.ABORT) -> bool:
        """End a request now (queued, prefilling, decoding or in flight). False if not live.

        `reason` is reported as the finish reason: the detokenizer aborts with STOP when it sees a
        stop string. Pages go back at once, or when the last in-flight step using them returns.
        """
        req = self.reqs.get(rid)
        if req is None:
            return False
        self._finish(req, FinishReason(reason))
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.inflight or self._events)

    def step(self) -> list[TokenEvent]:
        """One scheduling iteration: plan + launch a step, collect finished ones, report."""
        try:
            info = self.executor.check_worker()
        except WorkerFailed as exc:
            self._worker_down(exc)
            return self._take_events()
        self.worker_up = True
        if info is not None:
            self._worker_replaced(info)
        launched = self._plan()
        if launched.reqs:
            self._launch(launched)
        elif not self.inflight and (self.running or self.waiting):
            self._stalled()  # nothing planned, nothing to wait for: a bug, but never a hang
        keep = 1 if launched.reqs and not self.config.disable_overlap else 0
        while len(self.inflight) > keep:
            self._collect()
        return self._take_events()

    def probe_worker(self) -> list[TokenEvent]:
        """Between iterations with nothing to do: is the worker (still, again) there? Updates
        `worker_up` (a restarted worker is adopted at once). Costs nothing while a healthy step
        stream is open; one GetWorkerInfo otherwise."""
        try:
            info = self.executor.check_worker()
        except WorkerFailed as exc:
            if self.worker_up:
                log.warning("%s", exc)
            self._worker_down(exc)
            return self._take_events()
        if not self.worker_up:
            log.info("the worker answers again")
        self.worker_up = True
        if info is not None:
            self._worker_replaced(info)
        return self._take_events()

    def _take_events(self) -> list[TokenEvent]:
        events = list(self._events.values())
        self._events.clear()
        return events

    def stats(self) -> SchedulerStats:
        return SchedulerStats.of(len(self.running), len(self.waiting), len(self.inflight),
                                 self.kv, self._counters, worker_down=not self.worker_up)

    def check_invariants(self) -> None:
        """Page accounting and ref counts (tests; cheap enough for a debug flag)."""
        holders = [r for r in self.running] + list(self._zombies)
        self.kv.check(holders)
        slots = [r.slot for r in holders]
        assert len(set(slots)) == len(slots) and -1 not in slots, "slot reused while held"
        assert len(slots) + len(self._free_slots) == self.info.max_slots, "slot leaked"
        for req in self.waiting:
            assert not req.pages and req.node is None and req.slot == -1

    def close(self) -> None:
        self.executor.close()

    # -- planning ------------------------------------------------------------------------------

    def _plan(self) -> LaunchedStep:
        step = LaunchedStep(StepPlan(self._next_step))
        budget = self.config.max_prefill_tokens
        if self.pacer.enabled:
            # Sized for the deepest chunk in progress: chunks further into a prompt cost more.
            budget = self.pacer.budget(max((r.computed for r in self.running if r.prefilling),
                                           default=0))
        ps = self.page_size
        if (self._prioritized and self.config.max_priority_preemptions and self.waiting
                and self.running):
            self._preempt_for_priority(budget)
        windowed = self.kv.windowed
        for req in list(self.running):  # by rank: they win when memory is short
            if req.phase is not Phase.RUNNING:
                continue  # preempted or ended while planning this step
            if windowed:  # window pages no query from req.computed on can read
                self.kv.trim(req, req.computed, self._last_launched())
            if req.computed < req.target:  # prefilling
                if budget > 0 and (n := self._fit_chunk(req, budget)):
                    self._add_chunk(step, req, n)
                    budget -= n
            elif len(req.tokens) - req.prompt_len + req.pending_samples < req.max_tokens:
                # can_decode, inlined: this runs for every decoding request every step
                if req.computed < len(req.pages) * ps:
                    step.add_decode(req)  # its last page has room: the common case
                elif self._grow(req, req.computed + 1) and req.can_decode:
                    step.add_decode(req)
        self._admit(step, budget)
        step.seal()
        self._counters["decode"] += len(step.decode_reqs)
        self._counters["prefill"] += step.prefill_tokens
        return step

    def _last_launched(self) -> int | None:
        """The last step in flight (it may read what this plan drops), None if none is."""
        return self.inflight[-1].plan.step_id if self.inflight else None

    def _fit_chunk(self, req: Request, budget: int) -> int:
        """Tokens of the next prefill chunk of a running request that fit in memory (0: none)."""
        want = min(budget, req.target - req.computed)
        for _ in range(2):
            room = (len(req.pages) + self.kv.available) * self.page_size - req.computed
            if min(want, room) > 0:
                n = min(want, room)
                ok = self.kv.grow(req, req.computed + n)
                assert ok
                return n
            if not self._grow(req, req.computed + 1):  # preempts or drains to make room
                return 0
        return 0

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Pages for `num_tokens` positions of a running request, preempting younger ones."""
        while not self.kv.grow(req, num_tokens):
            if self.inflight:  # pages of finished requests may come back with these steps
                self._drain()
                if req.phase is not Phase.RUNNING:
                    return False
                continue
            victim = self.running[-1]
            if victim is req and self._zombies:
                return False  # ended requests in this plan give pages back after it: wait
            if victim is req and len(self.running) == 1:
                pool = f"the pool holds {self.kv.num_pages} pages"
                if self.kv.windowed:
                    pool += f" (its sliding-window pool {self.kv.window_pages})"
                self._finish(req, FinishReason.ERROR, SchedulerError(
                    f"the request needs {pages_for(num_tokens, self.page_size)} KV pages "
                    f"({num_tokens} tokens) but {pool}", ErrorCode.CONTEXT_LENGTH_EXCEEDED))
                return False
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _admit(self, step: LaunchedStep, budget: int) -> None:
        """Move waiting requests into slots while budget, slots and memory allow."""
        if not self.waiting:
            return
        ready_before = step.plan.step_id
        ps, ratio = self.page_size, self.config.decode_reserve_ratio
        reserve = sum(reserve_pages(r, ps, ratio) for r in self.running)
        reserve_win = sum(self._window_reserve(r) for r in self.running) if self.kv.windowed else 0
        cache = None if self._poisoned else self.kv.cache
        for req in waiting_order(self.waiting, cache, self.config, self.turns):
            if budget <= 0 or len(self.running) >= self.max_running or not self._free_slots:
                return
            use_cache = not self._poisoned
            match = (self.kv.match(req.tokens[: req.target - 1], ready_before, req.salt)
                     if use_cache else None)
            if match is not None and match.blocked:
                continue  # this step computes more of its prefix: next step gets it for free
            self.kv.attach(req, match)
            cached = len(req.pages) * self.page_size
            n = min(budget, req.target - cached)
            if self.kv.windowed:  # a first chunk the window pool can hold
                n = min(n, self.kv.win_available * ps)
                if n <= 0:
                    self.kv.detach(req)
                    return
            need = pages_for(cached + n, self.page_size) - len(req.pages)
            if not self.kv.fits(need, reserve, reserve_win):
                self.kv.detach(req)
                return  # keep arrival order: later requests do not jump the queue
            ok = self.kv.grow(req, cached + n)
            assert ok
            req.slot = heapq.heappop(self._free_slots)
            req.computed = cached
            req.phase = Phase.RUNNING
            self.waiting.remove(req)
            self.turns.admitted(req)
            bisect.insort(self.running, req, key=lambda r: r.rank)
            if req.cached_tokens < 0:
                req.cached_tokens = min(cached, req.prompt_len)
            self._counters["hit"] += cached
            self._counters["query"] += req.target
            self._add_chunk(step, req, n, start=True)
            budget -= n
            reserve += reserve_pages(req, ps, ratio)
            if self.kv.windowed:
                reserve_win += self._window_reserve(req)

    def _window_reserve(self, r: Request) -> int:
        """Window pages kept back for a running request: what it still needs, at most a window's
        worth (it drops older ones as it goes) and a prefill chunk's."""
        full = reserve_pages(r, self.page_size, self.config.decode_reserve_ratio)
        span = pages_for(self.kv.window + self.config.max_prefill_tokens, self.page_size) + 1
        return min(full, max(0, span - (len(r.win) - r.win_lo)))

    def _preempt_for_priority(self, budget: int) -> None:
        """Make room for the first waiting request (by priority) by preempting running ones of a
        strictly lower priority, lowest and youngest first, when it lacks a slot or pages."""
        head = min(self.waiting, key=lambda r: r.rank)
        ps, ratio = self.page_size, self.config.decode_reserve_ratio
        need = pages_for(min(budget, head.target), ps)  # its first chunk, before prefix hits
        left = self.config.max_priority_preemptions
        while left > 0 and self.running and self.running[-1].priority > head.priority:
            reserve = sum(reserve_pages(r, ps, ratio) for r in self.running)
            if (len(self.running) < self.max_running and self._free_slots
                    and need + reserve <= self.kv.available):
                return  # it fits: no one has to give way
            if self.inflight:  # a victim must not be in a launched step; finished ones free room
                self._drain()
                continue
            self._preempt(self.running[-1])
            left -= 1

    def _add_chunk(self, step: LaunchedStep, req: Request, n: int, start: bool = False) -> None:
        step.add_chunk(req, n, start)
        if not self._poisoned:
            self.kv.cache_prefix(req, req.computed, step.plan.step_id)

    # -- execution -----------------------------------------------------------------------------

    def _launch(self, step: LaunchedStep) -> None:
        if self.traces.live:  # only while a request is traced, or debug logging names them
            step.plan.traceparents = self.traces.on_launch(step)
        self._next_step += 1
        self._counters["steps"] += 1
        self.inflight.append(step)
        try:
            self.executor.launch(step.plan)
        except Exception as exc:  # the worker is gone or refused the plan
            self.inflight.pop()
            self._fail_step(step, exc)

    def _drain(self) -> None:
        while self.inflight:
            self._collect()

    def _collect(self) -> None:
        step = self.inflight.popleft()
        if self.traces.traced:
            self.traces.on_collect(step.plan.step_id)
        try:
            out = self.executor.collect()
            check_output(step, out)
        except Exception as exc:
            self._fail_step(step, exc)
            return
        if self.pacer.enabled:
            self.pacer.observe(step.prefill_tokens, attention_pairs(
                [(c.cache_len, len(c.input_ids)) for c in step.plan.reqs]), out.forward_ms)
        self._step_done(step)
        for req in step.reqs:
            req.inflight -= 1
        for i, req in enumerate(step.sampled):
            req.pending_samples -= 1
            if req.phase is Phase.RUNNING:
                end = take_token(req, self._event(req), out, i)
                if end is not None:
                    self._finish(req, end)
        for req in step.reqs:
            if req.phase is Phase.ENDED:
                self._maybe_release(req)
        self._maybe_unpoison()

    def _step_done(self, step: LaunchedStep) -> None:
        """`step` is over (collected or failed): window pages only it and older steps could
        read are free. A step failing at launch leaves older ones in flight: they still count."""
        if self.kv.windowed:
            self.kv.collected(self.inflight[0].plan.step_id - 1 if self.inflight
                              else step.plan.step_id)

    def _fail_step(self, step: LaunchedStep, exc: Exception) -> None:
        """A failed step leaves the worker's slots and KV suspect: fail everything running."""
        log.error("step %d failed: %s", step.plan.step_id, exc)
        error = exc if isinstance(exc, SchedulerError) else WorkerFailed(f"the worker failed: {exc}")
        if isinstance(error, WorkerFailed):
            self.worker_up = False  # until the next check finds it answering
        self._poisoned = True
        self._poison_until = self._next_step - 1  # the last step launched so far
        self._step_done(step)
        for req in step.reqs:
            req.inflight -= 1
            req.kv_valid = False
        for req in step.sampled:
            req.pending_samples -= 1
        for req in list(self.running):
            req.kv_valid = False
            self._finish(req, FinishReason.ERROR, error)
        for req in step.reqs:
            self._maybe_release(req)
        self._maybe_unpoison()

    def _worker_down(self, exc: WorkerFailed) -> None:
        """The worker cannot be reached: fail everything that waits for it now (no hang)."""
        self.worker_up = False
        self._drain()  # steps on the broken stream fail at once
        for req in self.running + self.waiting:
            self._finish(req, FinishReason.ERROR, exc)

    def _worker_replaced(self, info: WorkerInfo) -> None:
        """Another worker process answers: every page, slot and cached prefix we track is gone."""
        old = self.info
        log.warning(
            "the worker restarted (epoch %x -> %x): dropping the prefix cache (%d cached pages) "
            "and all page mappings, failing %d running requests, %d waiting start anew",
            old.epoch, info.epoch, self.kv.cached_pages, len(self.running), len(self.waiting))
        self._drain()  # steps sent to the old process fail (their stream broke)
        error = WorkerFailed("the worker restarted and lost this request's KV cache; retry")
        for req in list(self.running):
            req.kv_valid = False
            self._finish(req, FinishReason.ERROR, error)
        assert not self.inflight and not self._zombies
        # Nothing holds the old cache now: evicting it tells the listener (the Watch streams)
        # that those pages are gone, before the new, empty cache takes over.
        self.kv.drop_cache()
        self._poisoned = False
        self._adopt(info)

    def _maybe_unpoison(self) -> None:
        if self._poisoned and all(s.plan.step_id > self._poison_until for s in self.inflight):
            self.kv.drop_cache()  # nothing locks it: every request of those steps has ended
            self._poisoned = False

    def _stalled(self) -> None:
        # Unreachable by design (see tests); if it happens, fail loudly rather than spin forever.
        log.error("scheduler stalled: %d running, %d waiting, %d free pages",
                  len(self.running), len(self.waiting), self.kv.free_pages)
        error = SchedulerError("internal error: the scheduler could not make progress")
        for req in self.running + self.waiting:
            self._finish(req, FinishReason.ERROR, error)

    # -- request lifecycle ---------------------------------------------------------------------

    def _event(self, req: Request) -> TokenEvent:
        event = self._events.get(req)
        if event is None:
            event = self._events[req] = TokenEvent(
                req.rid, prompt_tokens=req.prompt_len, cached_tokens=max(0, req.cached_tokens))
        return event

    def _finish(self, req: Request, reason: FinishReason,
                error: SchedulerError | None = None) -> None:
        if req.phase is Phase.ENDED:
            return
        event = self._event(req)
        event.finish_reason, event.error = reason, error
        if req.phase is Phase.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            self._zombies.add(req)
        req.phase = Phase.ENDED
        self.reqs.pop(req.rid, None)
        self._counters["done"] += 1
        if self.traces.live:
            self.traces.finish(req, reason)
        self._maybe_release(req)

    def _maybe_release(self, req: Request) -> None:
        if req.inflight == 0 and req in self._zombies:
            self._zombies.discard(req)
            self._free_resources(req)

    def _free_resources(self, req: Request) -> None:
        self.kv.release(req, offer=req.kv_valid and not self._poisoned)
        heapq.heappush(self._free_slots, req.slot)
        req.slot = -1

    def _preempt(self, req: Request) -> None:
        """Back to the queue; recomputed later from prompt + outputs (already sent to the client)."""
        assert req.inflight == 0 and req.pending_samples == 0
        self.running.remove(req)
        self._free_resources(req)
        req.phase = Phase.WAITING
        req.computed, req.target = 0, len(req.tokens)
        self._counters["preempt"] += 1
        bisect.insort(self.waiting, req, key=lambda r: r.arrival)
        log.debug("preempted request %d after %d outputs", req.rid, req.num_outputs)
