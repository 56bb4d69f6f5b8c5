"""The columnar step contract: StepPlan <-> StepRequest without rows, and the PlanBuilder over
decode columns producing exactly what it produced when decodes were rows.

`data/plan_builder_rows.json` was recorded with the row-shaped contract (every entry a ReqPlan,
decodes first, as the scheduler sent them) by the PlanBuilder of commit 008ef4a: 40 seeded steps
over 8 slots with prefix hits, chunked and restarted prefills, decodes that grow a page, pure
decode steps built padded for a CUDA graph. It holds each step's rows and every tensor the
builder made from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from minisgl_core.convert import plan_from_proto, plan_to_proto
from minisgl_core.proto.minisgl.v1 import worker_pb2
from minisgl_core.sampling import SamplingParams
from minisgl_core.step import DecodeEntries, ReqPlan, StepPlan
from minisgl_worker.engine.batch import DeviceStep, InvalidPlan, PlanBuilder

RECORDED = Path(__file__).parent / "data" / "plan_builder_rows.json"


def _wire(plan: StepPlan) -> StepPlan:
    return plan_from_proto(worker_pb2.StepRequest.FromString(
        plan_to_proto(plan).SerializeToString()))


def test_round_trip_with_decodes_chunks_and_restarts() -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    # values exact in float32, the wire type
    penalized = SamplingParams(temperature=0.75, top_k=5, seed=3, max_tokens=20, min_tokens=4,
                               repetition_penalty=1.25, frequency_penalty=0.5, logprobs=True,
                               top_logprobs=2)
    plan = StepPlan(9, [
        ReqPlan(4, 2, 0, [11, 12], 0, [8], sampling=greedy, num_prompt_tokens=2),
        ReqPlan(6, 6, 4, [13, 14, 15], 0, [9, 10], sampling=penalized,
                history_ids=[1, 2, 3, 4], num_prompt_tokens=5),  # a restart after preemption
        ReqPlan(7, 4, 16, [21] * 5, 4, [30, 31], sample=False),  # a middle chunk
        ReqPlan(8, 7, 3, [22], 1, [], sample=True),  # a final chunk
    ])
    plan.decodes.add(1, 0, 7)
    plan.decodes.add(2, 3, 15, 3, [40])
    plan.decodes.add(3, 1, 4, 1, [5, 6])
    plan.decodes.add(5, 5, 9)
    msg = plan_to_proto(plan)
    assert list(msg.decodes.rids) == [1, 2, 3, 5] and list(msg.decodes.new_pages) == [40, 5, 6]
    assert list(msg.decodes.new_page_counts) == [0, 1, 2, 0]
    assert [m.rid for m in msg.requests] == [4, 6, 7, 8]
    back = _wire(plan)
    assert back == plan
    assert back.num_entries == 8


def test_a_step_without_decodes_sends_no_columns() -> None:
    plan = StepPlan(3, [ReqPlan(1, 0, 0, [5, 6], 0, [2], sampling=SamplingParams())])
    assert not plan_to_proto(plan).HasField("decodes")
    back = _wire(plan)
    assert back.decodes == DecodeEntries() and back.reqs == plan.reqs
    assert _wire(StepPlan(4)) == StepPlan(4)


def _columnar(step_id: int, rows: list[dict[str, Any]]) -> StepPlan:
    plan = StepPlan(step_id)
    for r in rows:
        if not r["input_ids"]:
            plan.decodes.add(r["rid"], r["slot"], r["cache_len"], r["page_offset"],
                             r["new_pages"])
        else:
            plan.reqs.append(ReqPlan(
                r["rid"], r["slot"], r["cache_len"], r["input_ids"], r["page_offset"],
                r["new_pages"], r["sample"],
                SamplingParams(temperature=0.0) if r["sampling"] else None, r["history_ids"],
                r["num_prompt_tokens"]))
    return plan


def _tensors(step: DeviceStep, writes: Any) -> dict[str, Any]:
    b = step.batch
    out: dict[str, Any] = {
        "batch_size": b.batch_size, "num_tokens": b.num_tokens, "is_decode": b.is_decode,
        "cache_lens_host": b.cache_lens_host, "extend_lens_host": b.extend_lens_host,
        "seq_lens_host": b.seq_lens_host, "max_seq_len": b.max_seq_len,
        "max_extend_len": b.max_extend_len, "sample_slots_host": step.sample_slots_host,
        "sample_rids": step.sample_rids, "decode_count": step.decode_count,
        "page_writes_host": writes.tolist(), "input_ids": step.input_ids.tolist(),
        "decode_index": step.decode_index.tolist(), "decode_slots": step.decode_slots.tolist(),
        "sample_slots": step.sample_slots.tolist(),
        "sample_positions": step.sample_positions.tolist(),
        "page_writes": step.page_writes.tolist(),
    }
    for name in ("positions", "out_loc", "slots", "cache_lens", "extend_lens", "seq_lens",
                 "qo_indptr", "page_table", "page_table_host", "sample_indices",
                 "qo_indptr_host", "kv_indptr_host", "kv_indices", "kv_last_page_len_host"):
        out[name] = getattr(b, name).tolist()
    return out


@pytest.mark.parametrize("through_wire", [False, True])
def test_plan_builder_over_columns_matches_the_recorded_rows(through_wire: bool) -> None:
    rec = json.loads(RECORDED.read_text())
    builder = PlanBuilder(rec["slots"], rec["max_pages"], rec["pages"], rec["page_size"],
                          rec["max_model_len"], rec["vocab"], torch.device("cpu"))
    graph = rec["slots"]
    decodes = 0
    for i, case in enumerate(rec["steps"]):
        plan = _columnar(i, case["rows"])
        if through_wire:
            plan = _wire(plan)
        decodes += len(plan.decodes)
        builder.validate(plan)
        step, writes = builder.build(plan, (lambda n: graph if n <= graph else None)
                                     if case["graph"] else None)
        got = _tensors(step, writes)
        want = case["expect"]
        assert got.keys() <= want.keys()
        for key, value in got.items():
            assert value == want[key], (i, key)
    assert decodes > 100  # the record does exercise the decode columns


def test_window_pages_cross_the_wire_aligned_with_pages() -> None:
    """A worker with a window pool gets each new page's window-pool page (-1: none kept);
    without one, plans carry none and the message is byte for byte what it was."""
    plan = StepPlan(5, [ReqPlan(4, 1, 0, [1, 2, 3, 4, 5], 0, [7, 8], sampling=SamplingParams(),
                                new_window_pages=[-1, 3])])
    plan.decodes.add(1, 0, 12, 3, [9], [2])
    plan.decodes.add(2, 2, 6)
    msg = plan_to_proto(plan)
    assert list(msg.decodes.new_window_pages) == [2]
    assert list(msg.requests[0].new_window_pages) == [-1, 3]
    assert _wire(plan) == plan
    bare = StepPlan(5, [ReqPlan(4, 1, 0, [1, 2], 0, [7], sampling=SamplingParams())])
    bare.decodes.add(1, 0, 12, 3, [9])
    m = plan_to_proto(bare)
    sent = {f.name for f, _ in m.decodes.ListFields()} | {
        f.name for f, _ in m.requests[0].ListFields()}
    assert "new_window_pages" not in sent and _wire(bare) == bare
    bad = StepPlan(6)
    bad.decodes.add(1, 0, 12, 3, [9, 10], [2])  # one window page for two pages
    assert not bad.decodes.consistent()


def test_plan_builder_window_table() -> None:
    cpu = torch.device("cpu")
    b = PlanBuilder(2, 8, 16, 4, 32, 100, cpu, window_pages=6)
    ok = StepPlan(1, [ReqPlan(0, 1, 0, list(range(10)), 0, [3, 4, 5], sampling=SamplingParams(),
                              new_window_pages=[-1, 0, 5])])
    b.validate(ok)
    step, _ = b.build(ok)
    batch = step.batch
    assert batch.window_page_table is not None and batch.window_out_loc is not None
    assert batch.window_page_table.tolist() == [[6, 0, 5]]  # -1 is the window dummy page
    assert batch.window_out_loc.tolist()[4:6] == [0, 1]  # position 4: window page 0
    assert batch.window_out_loc.tolist()[:4] == [24, 25, 26, 27]  # the dummy page
    for wrong in ([0, 1], [0, 1, 6], [0, -2, 1]):  # misaligned, out of range
        bad = StepPlan(2, [ReqPlan(0, 0, 0, [1], 0, [3, 4, 5], sampling=SamplingParams(),
                                   new_window_pages=wrong)])
        with pytest.raises(InvalidPlan, match="new_window_pages"):
            b.validate(bad)
    plain = PlanBuilder(2, 8, 16, 4, 32, 100, cpu)
    with pytest.raises(InvalidPlan, match="without a window pool"):
        plain.validate(ok)
    step, _ = plain.build(StepPlan(3, [ReqPlan(0, 0, 0, [1], 0, [3], sampling=SamplingParams())]))
    assert step.batch.window_page_table is None and step.batch.window_out_loc is None
