"""A step from planning to collection: its plan, written entry by entry as the scheduler decides,
and the requests behind the entries.

The scheduler decides which requests go into a step; this module is how a request becomes an
entry of the step contract (`minisgl_core.step`): a decode is appended to the plan's columns,
a prefill chunk becomes a `ReqPlan`. Each entry holds a reference on its request (`inflight`,
and `pending_samples` when it samples) until the step is collected or fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl_core.step import ReqPlan, StepOutput, StepPlan

from minisgl_scheduler.errors import SchedulerError
from minisgl_scheduler.request import Request


@dataclass(slots=True)
class LaunchedStep:
    plan: StepPlan
    decode_reqs: list[Request] = field(default_factory=list)  # aligned with plan.decodes
    chunk_reqs: list[Request] = field(default_factory=list)  # aligned with plan.reqs
    sampled_chunks: list[Request] = field(default_factory=list)  # plan.reqs with sample=True
    # After `seal`, in the step's row order (decodes, then chunks):
    reqs: list[Request] = field(default_factory=list)  # every entry
    sampled: list[Request] = field(default_factory=list)  # entries that sample (StepOutput's)
    prefill_tokens: int = 0

    def add_decode(self, req: Request) -> None:
        """A decode entry for `req` (its input is the token the worker sampled last)."""
        d = self.plan.decodes
        sent = req.sent_pages
        pages = req.pages
        d.rids.append(req.rid)
        d.slots.append(req.slot)
        d.cache_lens.append(req.computed)
        d.page_offsets.append(sent)
        d.new_page_counts.append(len(pages) - sent)
        if sent < len(pages):
            d.new_pages.extend(pages[sent:])
            if req.win:  # a window pool: the same logical pages' window pages
                d.new_window_pages.extend(req.win[sent:])
        self.decode_reqs.append(req)
        req.sent_pages = len(pages)
        req.computed += 1
        req.inflight += 1
        req.pending_samples += 1

    def add_chunk(self, req: Request, n: int, start: bool = False) -> None:
        """The next `n` tokens of `req`'s prefill; `start`: it (re)starts in its slot, so the
        entry carries the whole page row and the sampling parameters."""
        begin = req.computed
        sample = begin + n == req.target
        self.plan.reqs.append(ReqPlan(
            rid=req.rid, slot=req.slot, cache_len=begin, input_ids=req.tokens[begin:begin + n],
            page_offset=0 if start else req.sent_pages,
            new_pages=list(req.pages) if start else req.pages[req.sent_pages:],
            new_window_pages=(list(req.win) if start else req.win[req.sent_pages:]) if req.win
            else [],
            sample=sample, sampling=req.restart_params() if start else None,
            history_ids=req.tokens[:begin] if start and req.params.needs_penalties else [],
            num_prompt_tokens=req.prompt_len if start else 0,
        ))
        self.chunk_reqs.append(req)
        self.prefill_tokens += n
        req.sent_pages = len(req.pages)
        req.computed += n
        req.inflight += 1
        if sample:
            self.sampled_chunks.append(req)
            req.pending_samples += 1

    def seal(self) -> None:
        """Planning is over: the requests in row order (every decode samples)."""
        self.reqs = self.decode_reqs + self.chunk_reqs
        self.sampled = self.decode_reqs + self.sampled_chunks


def check_output(step: LaunchedStep, out: StepOutput) -> None:
    if out.step_id != step.plan.step_id:
        raise SchedulerError(f"worker answered step {out.step_id}, expected {step.plan.step_id}")
    want = step.plan.decodes.rids + [r.rid for r in step.sampled_chunks]
    if list(out.rids) != want or len(out.token_ids) != len(out.rids):
        raise SchedulerError(f"worker output for step {out.step_id} does not match its plan")
