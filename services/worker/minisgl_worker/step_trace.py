"""The worker's part of a request's trace: one span per step that holds a traced prefill chunk.

The scheduler sends, with such a step only, the traceparents of its traced chunks' spans
(`StepRequest.traceparents`); the step's span goes under the first and links the rest. Decode
steps get none (one span per token would cost more than the step). A request (re)starting in a
slot carries its request id while the scheduler logs or traces requests: a debug line names it.
Per step, with tracing off and no debug logging, this is two cheap checks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from minisgl_core import tracing
from minisgl_core.logging import log_fields
from minisgl_core.proto.minisgl.v1 import worker_pb2
from minisgl_core.step import StepOutput, StepPlan

if TYPE_CHECKING:  # opentelemetry is imported at run time only with tracing on
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)


def step_started(msg: worker_pb2.StepRequest, plan: StepPlan) -> Span | None:
    if log.isEnabledFor(logging.DEBUG):
        for r in plan.reqs:
            if r.request_id:
                log.debug("request starts in slot %d at step %d", r.slot, plan.step_id,
                          extra=log_fields(request_id=r.request_id, rid=r.rid,
                                           cache_len=r.cache_len, tokens=len(r.input_ids)))
    if not msg.traceparents or not tracing.ENABLED:
        return None
    return tracing.start_span("worker_step", msg.traceparents[0], {
        "minisgl.step_id": plan.step_id, "minisgl.batch_size": plan.num_entries,
        "minisgl.tokens": len(plan.decodes.rids) + sum(len(r.input_ids) for r in plan.reqs)},
        links=msg.traceparents[1:])


def step_ended(span: Span, out: StepOutput | None) -> None:
    if out is not None:
        span.set_attribute("minisgl.forward_ms", out.forward_ms)
    span.end()
