"""A minimal scheduler for worker tests: slots, pages, chunked prefill, staggered arrivals.

It knows nothing of the engine's internals: it builds StepPlans the way the real scheduler does
(pages handed out as sequences grow, decodes in the plan's columns reading the token futures,
overlap: step N+1 launched before step N is collected) and returns each request's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl_core.sampling import SamplingParams
from minisgl_core.step import ReqPlan, StepExecutor, StepPlan

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


def with_window_pages(engine: object, plan: StepPlan) -> StepPlan:
    """`plan` for an engine with a sliding-window pool (`engine.window_pages` > 0): every new
    page gets the window page of the same id, and none is ever dropped, so the windowed layers'
    table equals the main one (the pool must have as many pages as the plans use). Tests that
    hand-build plans for windowed models send these; dropping pages is the scheduler's job
    (tests/worker/test_window_pool.py)."""
    if not getattr(engine, "window_pages", 0):
        return plan
    for r in plan.reqs:
        r.new_window_pages = list(r.new_pages)
    plan.decodes.new_window_pages = list(plan.decodes.new_pages)
    return plan


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    max_new: int
    start_step: int
    slot: int = -1
    pages: list[int] = field(default_factory=list)
    fed: int = 0  # prompt tokens sent
    launched: int = 0  # sampled tokens launched
    out: list[int] = field(default_factory=list)


def run_requests(engine: StepExecutor, prompts: list[list[int]], max_new: int,
                 page_size: int, chunk: int | None = None, starts: list[int] | None = None,
                 overlap: bool = True,
                 params: SamplingParams | list[SamplingParams] = GREEDY,
                 first_page: int = 0) -> list[list[int]]:
    """`params`: one for every request, or a list with each request's."""
    per_req = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [_Req(i, p, max_new, (starts or [0] * len(prompts))[i]) for i, p in enumerate(prompts)]
    free_slots = list(range(len(prompts)))
    next_page = first_page
    pending: list[list[tuple[_Req, bool]]] = []  # per launched step: (req, sampled)
    step_id = 0

    def collect() -> None:
        owners = [r for r, sampled in pending.pop(0) if sampled]
        out = engine.collect()
        assert out.rids == [r.rid for r in owners], (out.rids, [r.rid for r in owners])
        for r, tok in zip(owners, out.token_ids, strict=True):
            r.out.append(tok)

    while any(r.launched < r.max_new for r in reqs):
        plan = StepPlan(step_id=step_id)
        decodes: list[tuple[_Req, bool]] = []
        chunks: list[tuple[_Req, bool]] = []
        for r in reqs:
            if r.start_step > step_id or r.launched >= r.max_new:
                continue
            restart = r.slot < 0
            if restart:
                r.slot = free_slots.pop(0)
            if r.fed < len(r.prompt):
                n = len(r.prompt) - r.fed if chunk is None else min(chunk, len(r.prompt) - r.fed)
                ids, cache = r.prompt[r.fed:r.fed + n], r.fed
            else:
                n, ids, cache = 1, [], len(r.prompt) + r.launched - 1
            need = -(-(cache + n) // page_size)
            new = list(range(next_page, next_page + need - len(r.pages)))
            next_page += len(new)
            offset = len(r.pages)
            r.pages += new
            sample = r.fed + len(ids) >= len(r.prompt)
            if ids:
                plan.reqs.append(ReqPlan(rid=r.rid, slot=r.slot, cache_len=cache, input_ids=ids,
                                         page_offset=offset, new_pages=new, sample=sample,
                                         sampling=per_req[r.rid] if restart else None))
                chunks.append((r, sample))
            else:
                plan.decodes.add(r.rid, r.slot, cache, offset, new)
                decodes.append((r, sample))
            r.fed += len(ids)
            r.launched += int(sample)
        engine.launch(with_window_pages(engine, plan))
        pending.append(decodes + chunks)  # the step's rows: decodes first
        step_id += 1
        while len(pending) > (1 if overlap else 0):
            collect()
    while pending:
        collect()
    return [r.out for r in reqs]
