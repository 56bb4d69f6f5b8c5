"""Priorities (vLLM's: lower values first) and tenants in the scheduler: admission order,
preemption of lower-priority running requests, bounded preemption, tenant interleaving."""

from __future__ import annotations

import pytest
from minisgl_core.sampling import SamplingParams
from minisgl_scheduler import FinishReason, Scheduler, SchedulerConfig

from .fake_executor import FakeExecutor, reference
from .helpers import Recorder, assert_all_pages_back, run

LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def make(overlap: bool = False, num_pages: int = 64, page_size: int = 4, max_slots: int = 16,
         **kw: object) -> tuple[FakeExecutor, Scheduler]:
    fake = FakeExecutor(num_pages=num_pages, page_size=page_size, max_slots=max_slots)
    return fake, Scheduler(fake, SchedulerConfig(disable_overlap=not overlap, **kw))  # type: ignore[arg-type]


def admitted_order(fake: FakeExecutor) -> list[int]:
    """Rids in the order their first prefill chunk was planned."""
    seen: list[int] = []
    for plan in fake.plans:
        for r in plan.reqs:
            if r.input_ids and r.rid not in seen:
                seen.append(r.rid)
    return seen


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    fake, s = make(max_running_requests=1)
    for rid, prio in enumerate([0, 5, -1, 5, -1, 0]):
        s.submit(rid, [rid + 3] * 5, SHORT, priority=prio)
    rec = run(s)
    # All six wait before the first step: the order is by priority, then arrival.
    assert admitted_order(fake) == [2, 4, 0, 5, 1, 3]
    assert all(o.finish is FinishReason.LENGTH for o in rec.out.values())
    assert_all_pages_back(s)


def test_default_priority_keeps_arrival_order() -> None:
    fake, s = make(max_running_requests=1)
    for rid in range(5):
        s.submit(rid, [rid + 3] * 5, SHORT)
    run(s)
    assert admitted_order(fake) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("short_of", ["slots", "pages"])
def test_high_priority_preempts_low_priority_running(overlap: bool, short_of: str) -> None:
    # Either every slot is taken, or the pool is too small for the urgent prompt.
    if short_of == "slots":
        fake, s = make(overlap, max_running_requests=2, num_pages=256)
    else:
        fake, s = make(overlap, num_pages=24, page_size=4, decode_reserve_ratio=0.0)
    low = [s.submit(rid, [rid + 3] * 30, LONG, priority=10) for rid in (0, 1)]
    assert low == [None, None]
    rec = Recorder()
    for _ in range(6):  # both low-priority requests run and decode
        rec.add(s.step())
    assert {r.rid for r in s.running} == {0, 1}
    s.submit(7, [9] * 40, SHORT, priority=-5)
    steps_to_first = 0
    while 7 not in rec.out or not rec.out[7].tokens:
        rec.add(s.step())
        s.check_invariants()
        steps_to_first += 1
    assert steps_to_first <= 4  # it did not wait for a 40-token request to finish
    assert s.stats().preemptions >= 1
    run(s, rec)
    # Preempted requests are recomputed, not failed: the outputs are those of an unloaded run.
    for rid in (0, 1):
        assert rec.out[rid].finish is FinishReason.LENGTH
        assert rec.out[rid].tokens == reference([rid + 3] * 30, LONG, fake)
    assert rec.out[7].tokens == reference([9] * 40, SHORT, fake)
    assert_all_pages_back(s)


def test_equal_or_lower_priority_never_preempts() -> None:
    _, s = make(max_running_requests=1, num_pages=256)
    s.submit(0, [3] * 10, LONG, priority=0)
    s.step()
    s.submit(1, [4] * 10, SHORT, priority=0)
    s.submit(2, [5] * 10, SHORT, priority=3)
    run(s)
    assert s.stats().preemptions == 0


def test_priority_preemption_can_be_turned_off() -> None:
    _, s = make(max_running_requests=1, num_pages=256, max_priority_preemptions=0)
    s.submit(0, [3] * 10, LONG, priority=1)
    s.step()
    s.submit(1, [4] * 10, SHORT, priority=0)
    run(s)
    assert s.stats().preemptions == 0


def test_preemptions_per_step_are_capped() -> None:
    # Eight low-priority requests hold every slot; one urgent request needs one slot, so exactly
    # one is preempted; the cap bounds a step even when more would be needed.
    fake, s = make(max_running_requests=8, num_pages=512, max_priority_preemptions=1)
    for rid in range(8):
        s.submit(rid, [rid + 3] * 8, LONG, priority=1)
    s.step()
    assert len(s.running) == 8
    s.submit(100, [7] * 8, SHORT, priority=0)
    s.step()
    assert s.stats().preemptions == 1
    assert [r.rid for r in s.waiting] == [7]  # the youngest of the lowest priority gave way
    rec = run(s)
    assert s.stats().preemptions == 1  # the victim waits its turn; it preempts no one
    assert all(o.finish is FinishReason.LENGTH for o in rec.out.values())
    assert_all_pages_back(s)


def test_tenants_are_interleaved_within_a_priority() -> None:
    fake, s = make(max_running_requests=1)
    # Tenant 1 floods first; tenant 2 arrives later but is not served after the whole flood.
    for rid in range(6):
        s.submit(rid, [rid + 3] * 5, SHORT, tenant=1)
    for rid in (10, 11):
        s.submit(rid, [rid + 3] * 5, SHORT, tenant=2)
    run(s)
    assert admitted_order(fake) == [0, 10, 1, 11, 2, 3, 4, 5]


def test_priority_beats_tenant_turns() -> None:
    fake, s = make(max_running_requests=1)
    s.submit(0, [3] * 5, SHORT, tenant=1, priority=1)
    s.submit(1, [4] * 5, SHORT, tenant=1, priority=1)
    s.submit(2, [5] * 5, SHORT, tenant=2, priority=0)
    s.submit(3, [6] * 5, SHORT, tenant=2, priority=0)
    run(s)
    assert admitted_order(fake) == [2, 3, 0, 1]


def test_submit_items_carry_priority_and_tenant_to_the_loop() -> None:
    from minisgl_core.proto.minisgl.v1 import scheduler_pb2
    from minisgl_scheduler.server import _batch

    msg = scheduler_pb2.ConnectRequest(submits=[
        scheduler_pb2.SubmitItem(rid=1, input_ids=[3, 4], priority=-2, tenant=2**63 + 5),
        scheduler_pb2.SubmitItem(rid=2, input_ids=[3, 4]),
    ])
    batch = _batch(None, msg, 16)  # type: ignore[arg-type]
    assert [(s.priority, s.tenant) for s in batch.submits] == [(-2, 2**63 + 5), (0, 0)]
