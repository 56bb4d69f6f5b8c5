"""A step between planning and collection: its plan and the requests behind each entry."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl_core.step import ReqPlan, StepOutput, StepPlan

from minisgl_scheduler.errors import SchedulerError
from minisgl_scheduler.request import Request


@dataclass(slots=True)
class LaunchedStep:
    plan: StepPlan
    reqs: list[Request] = field(default_factory=list)  # aligned with plan.reqs
    sampled: list[Request] = field(default_factory=list)  # entries with sample=True, in order
    # Decode entries while planning; `seal` puts them first, the worker's columnar layout.
    decode_plans: list[ReqPlan] = field(default_factory=list)
    decode_reqs: list[Request] = field(default_factory=list)

    def seal(self) -> None:
        if self.decode_reqs:
            self.plan.reqs[:0] = self.decode_plans
            self.reqs[:0] = self.decode_reqs
            self.sampled[:0] = self.decode_reqs  # every decode entry samples


def check_output(step: LaunchedStep, out: StepOutput) -> None:
    if out.step_id != step.plan.step_id:
        raise SchedulerError(f"worker answered step {out.step_id}, expected {step.plan.step_id}")
    if list(out.rids) != [r.rid for r in step.sampled] or len(out.token_ids) != len(out.rids):
        raise SchedulerError(f"worker output for step {out.step_id} does not match its plan")
