"""Per-request metrics of the scheduler: phase timing for vLLM-style histograms, time to first
token, inter-token latency, end-to-end latency, token counts and finish reasons.

    arrival --queue--> first scheduled --prefill--> first token --decode--> last token
                       `------------------ inference ----------------------'

The server's route hands each token event to `RequestClock.event` (one call per event, nothing when
metrics are off). "First scheduled" is seen at the end of the loop iteration that took the request out of the
waiting queue (the scheduler core keeps no clock); a preempted request keeps its first time, as
vLLM's does. Only requests not yet scheduled are looked at after each iteration, by rid.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from minisgl_scheduler.metrics import SchedulerMetrics
from minisgl_scheduler.request import FinishReason, Phase, TokenEvent
from minisgl_scheduler.scheduler import Scheduler


@dataclass(slots=True)
class _Times:
    arrived: float
    prompt_len: int
    scheduled: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    generated: int = 0


class RequestClock:
    def __init__(self, metrics: SchedulerMetrics, scheduler: Scheduler) -> None:
        self.m = metrics
        self.sched = scheduler
        self.now = time.monotonic  # when an event is routed (tests set the time)
        self._live: dict[int, _Times] = {}
        self._unscheduled: set[int] = set()

    def submitted(self, rid: int, now: float, prompt_len: int, max_tokens: int) -> None:
        self.m.prompt_tokens.inc(prompt_len)
        self._live[rid] = _Times(now, prompt_len)
        self._unscheduled.add(rid)
        req = self.sched.reqs.get(rid)
        self.m.max_tokens.observe(req.max_tokens if req is not None else max_tokens)

    def after_step(self, now: float) -> None:
        if not self._unscheduled:
            return
        reqs = self.sched.reqs
        for rid in [r for r in self._unscheduled
                    if (q := reqs.get(r)) is None or q.phase is not Phase.WAITING]:
            self._unscheduled.discard(rid)
            t = self._live.get(rid)
            if t is not None and not t.scheduled:
                t.scheduled = now
                self.m.queue.observe(now - t.arrived)

    def refused(self) -> None:
        """A submit the scheduler refused: it ends at once, with an error."""
        self.m.finished(FinishReason.ERROR.value).inc()

    def event(self, ev: TokenEvent) -> None:
        """A step's news for a live request: its new tokens, and/or its end. Runs for every
        decoding request every step: the token part is inline, no further call."""
        now = self.now()
        count = len(ev.token_ids)
        if count and (t := self._live.get(ev.rid)) is not None:
            m = self.m
            if not t.scheduled:  # scheduled and answered within one iteration
                self.after_step(now)
            if not t.first_token:
                t.first_token = now
                m.ttft.observe(now - t.arrived)
                m.prefill.observe(now - (t.scheduled or t.arrived))
            else:  # tokens that came together share the time since the last ones
                gap = (now - t.last_token) / count
                for _ in range(count):
                    m.itl.observe(gap)
            m.generation_tokens.inc(count)
            t.last_token = now
            t.generated += count
        if ev.finish_reason is not None:
            self.finished(ev.rid, ev.finish_reason, now)

    def finished(self, rid: int, reason: FinishReason, now: float) -> None:
        self.m.finished(reason.value).inc()
        t = self._live.pop(rid, None)
        self._unscheduled.discard(rid)
        if t is None:
            return
        self.m.e2e.observe(now - t.arrived)
        self.m.prompt_len.observe(t.prompt_len)
        self.m.generation_len.observe(t.generated)
        if t.scheduled:
            self.m.inference.observe(now - t.scheduled)
        if t.first_token:
            self.m.decode.observe(t.last_token - t.first_token)
            if t.generated > 1:
                self.m.tpot.observe((t.last_token - t.first_token) / (t.generated - 1))

    def forget(self, rid: int) -> None:
        """The request's connection is gone: no histogram for it."""
        self._live.pop(rid, None)
        self._unscheduled.discard(rid)
