"""Spans and request-id log lines for the requests the scheduler batches.

A traced request (its SubmitItem carried a traceparent and tracing is on here) gets, under the
gateway's request span:

* `queue`: from submit to the first step that holds it (admission);
* `prefill_chunk`: one per chunk, from the step's launch to its collection, with the step id,
  batch size, chunk tokens and cache length; its traceparent goes to the worker in the step;
* `decode`: one span from the first decode step to the end, with the first/last step ids, the
  number of decode steps and the largest batch as attributes (no per-token events), and an
  event per preemption.

Which requests a step holds is read from `Request.computed` moving (O(traced requests) per step,
not O(batch)); nothing runs per step while no traced request is live (`RequestTraces.traced`).
Request ids are kept only while debug logging is on, for the queued/finished lines.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minisgl_core import tracing
from minisgl_core.logging import log_fields

from minisgl_scheduler.launched import LaunchedStep
from minisgl_scheduler.request import FinishReason, Phase, Request

if TYPE_CHECKING:  # opentelemetry is imported at run time only with tracing on
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class RequestTrace:
    req: Request
    request_id: str
    parent: str  # the gateway's span (traceparent)
    queue: Span | None = None
    decode: Span | None = None
    seen: int = 0  # req.computed at the last step that held it
    first_decode_step: int = 0
    last_decode_step: int = 0
    decode_steps: int = 0
    max_batch: int = 0


@dataclass
class RequestTraces:
    traced: dict[int, RequestTrace] = field(default_factory=dict)  # rid -> trace (spans)
    ids: dict[int, str] = field(default_factory=dict)  # rid -> request id (debug logs only)
    _chunks: dict[int, list[Span]] = field(default_factory=dict)  # step id -> open chunk spans

    @property
    def live(self) -> bool:
        return bool(self.traced or self.ids)

    def add(self, req: Request, traceparent: str, request_id: str) -> None:
        """A submitted request: its queue span starts now."""
        if traceparent and tracing.ENABLED:
            t = RequestTrace(req, request_id, traceparent)
            t.queue = tracing.start_span("queue", traceparent, {
                "minisgl.request_id": request_id, "minisgl.prompt_tokens": req.prompt_len})
            self.traced[req.rid] = t
        if request_id and log.isEnabledFor(logging.DEBUG):
            self.ids[req.rid] = request_id
            log.debug("queued", extra=log_fields(request_id=request_id, rid=req.rid,
                                                 prompt_tokens=req.prompt_len))

    def on_launch(self, step: LaunchedStep) -> list[str]:
        """Spans for the traced requests this step holds; the traceparents of its prefill
        chunks (for the worker's span of the step)."""
        step_id, batch = step.plan.step_id, len(step.reqs)
        links: list[str] = []
        for plan in step.plan.reqs:
            if plan.sampling is not None:  # (re)starts in a slot: the worker logs its id
                t0 = self.traced.get(plan.rid)
                plan.request_id = self.ids.get(plan.rid) or (t0.request_id if t0 else "")
        for t in self.traced.values():
            req = t.req
            if req.phase is not Phase.RUNNING:
                continue
            prev = t.seen
            if req.computed < prev:  # preempted and restarted: recomputed from position 0
                prev = 0
                if t.decode is not None:
                    t.decode.add_event("preempted", {"minisgl.step_id": step_id})
            if req.computed == prev:
                continue  # not in this step
            t.seen = req.computed
            if t.queue is not None:
                t.queue.set_attribute("minisgl.admitted_step_id", step_id)
                t.queue.end()
                t.queue = None
            if prev < req.target:
                chunk = tracing.start_span("prefill_chunk", t.parent, {
                    "minisgl.request_id": t.request_id, "minisgl.step_id": step_id,
                    "minisgl.batch_size": batch, "minisgl.chunk_tokens": req.computed - prev,
                    "minisgl.cache_len": prev})
                self._chunks.setdefault(step_id, []).append(chunk)
                links.append(tracing.traceparent_of(chunk))
                continue
            if t.decode is None:
                t.decode = tracing.start_span("decode", t.parent, {
                    "minisgl.request_id": t.request_id})
                t.first_decode_step = step_id
            t.decode_steps += 1
            t.last_decode_step = step_id
            t.max_batch = max(t.max_batch, batch)
        return [tp for tp in links if tp]

    def on_collect(self, step_id: int) -> None:
        for span in self._chunks.pop(step_id, ()):
            span.end()

    def finish(self, req: Request, finish_reason: FinishReason) -> None:
        request_id = self.ids.pop(req.rid, "")
        if request_id:
            log.debug("finished", extra=log_fields(
                request_id=request_id, rid=req.rid, outputs=req.num_outputs,
                reason=finish_reason.value))
        t = self.traced.pop(req.rid, None)
        if t is None:
            return
        reason = finish_reason.value
        if t.queue is not None:  # ended before admission
            t.queue.set_attribute("minisgl.finish_reason", reason)
            t.queue.end()
        if t.decode is not None:
            t.decode.set_attributes({
                "minisgl.first_step_id": t.first_decode_step,
                "minisgl.last_step_id": t.last_decode_step,
                "minisgl.decode_steps": t.decode_steps, "minisgl.max_batch_size": t.max_batch,
                "minisgl.output_tokens": req.num_outputs, "minisgl.finish_reason": reason})
            if finish_reason is FinishReason.ERROR:
                from opentelemetry.trace import Status, StatusCode

                t.decode.set_status(Status(StatusCode.ERROR))
            t.decode.end()
