"""CPU micro-benchmark of the step contract's host path at a full decode batch.

    python bench/micro/step_contract.py [--decodes 256] [--steps 400] [--repeat 3]

Three parts of one decode step, each timed on its own over the same steady-state plans (every
request decoding, no prefill):

* schedule: `Scheduler.step()` over an executor that answers at once (planning, launch,
  collecting the previous step's tokens), overlap on;
* wire: `plan_to_proto` -> bytes -> `plan_from_proto`, what the scheduler and worker do around
  the gRPC stream;
* build: the worker's `PlanBuilder.validate` + `build` on the CPU device (host metadata only).

Prints µs per step for each part, the best and the median of `--repeat` runs (on a shared
machine the best is the steadier figure).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

import torch
from minisgl_core import convert
from minisgl_core.proto.minisgl.v1 import worker_pb2
from minisgl_core.sampling import SamplingParams
from minisgl_core.step import StepExecutor, StepOutput, StepPlan, WorkerInfo
from minisgl_scheduler.config import SchedulerConfig
from minisgl_scheduler.scheduler import Scheduler
from minisgl_worker.engine.batch import PlanBuilder

PAGE_SIZE = 16
PROMPT_LEN = 32
VOCAB = 32000


def sampled_rids(plan: StepPlan) -> list[int]:
    return plan.decodes.rids + [r.rid for r in plan.reqs if r.sample]


def is_pure_decode(plan: StepPlan) -> bool:
    return not plan.reqs


def to_wire(plan: StepPlan) -> bytes:
    data: bytes = convert.plan_to_proto(plan).SerializeToString()
    return data


class RecordingExecutor(StepExecutor):
    """Answers every step at once with a fixed token; keeps the plans it saw."""

    def __init__(self, max_slots: int, num_pages: int, max_model_len: int) -> None:
        self._info = WorkerInfo(model_name="null", num_pages=num_pages, page_size=PAGE_SIZE,
                                max_model_len=max_model_len, max_slots=max_slots,
                                vocab_size=VOCAB, eos_token_ids=[2])
        self.queue: deque[StepPlan] = deque()
        self.plans: list[StepPlan] = []

    def info(self) -> WorkerInfo:
        return self._info

    def launch(self, plan: StepPlan) -> None:
        self.queue.append(plan)
        self.plans.append(plan)

    def collect(self) -> StepOutput:
        plan = self.queue.popleft()
        rids = sampled_rids(plan)
        return StepOutput(plan.step_id, rids, [7] * len(rids))


def run(decodes: int, steps: int) -> dict[str, float]:
    max_model_len = PROMPT_LEN + steps + 64
    pages_per_req = -(-max_model_len // PAGE_SIZE)
    ex = RecordingExecutor(decodes, decodes * pages_per_req + 16, max_model_len)
    sched = Scheduler(ex, SchedulerConfig(max_running_requests=decodes,
                                          max_prefill_tokens=decodes * PROMPT_LEN))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 32, ignore_eos=True)
    for rid in range(decodes):
        sched.submit(rid, [(rid * 31 + i) % VOCAB + 3 for i in range(PROMPT_LEN)], params)
    while not ex.plans or not (is_pure_decode(ex.plans[-1])
                               and len(sampled_rids(ex.plans[-1])) == decodes):
        sched.step()
    warm = len(ex.plans)
    t0 = time.perf_counter_ns()
    for _ in range(steps):
        sched.step()
    t_sched = (time.perf_counter_ns() - t0) / steps / 1e3
    timed = ex.plans[warm:]
    assert all(is_pure_decode(p) and len(sampled_rids(p)) == decodes for p in timed)

    t0 = time.perf_counter_ns()
    for p in timed:
        convert.plan_from_proto(worker_pb2.StepRequest.FromString(to_wire(p)))
    t_wire = (time.perf_counter_ns() - t0) / len(timed) / 1e3

    builder = PlanBuilder(decodes, pages_per_req, ex.info().num_pages, PAGE_SIZE, max_model_len,
                          VOCAB, torch.device("cpu"))
    for p in ex.plans[:warm]:  # the prefills: page tables and token futures as the worker has them
        builder.validate(p)
        builder.build(p)
    t0 = time.perf_counter_ns()
    for p in timed:
        builder.validate(p)
        builder.build(p)
    t_build = (time.perf_counter_ns() - t0) / len(timed) / 1e3
    return {"schedule": t_sched, "wire": t_wire, "build": t_build}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decodes", type=int, default=256)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = [run(args.decodes, args.steps) for _ in range(args.repeat)]
    for name, stat in (("best", min), ("median", statistics.median)):
        parts = {k: stat(r[k] for r in runs) for k in runs[0]}
        print(f"{args.decodes} decodes, {args.steps} steps, {name} of {args.repeat}: "
              + ", ".join(f"{k} {v:.0f} µs" for k, v in parts.items())
              + f", total {sum(parts.values()):.0f} µs")


if __name__ == "__main__":
    main()
