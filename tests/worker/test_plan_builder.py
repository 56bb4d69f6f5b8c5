"""The PlanBuilder on its own: graph padding, the FlashInfer page layout it ships, and the two
validation paths (numpy columns first, the per-entry walk for the message) agreeing."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from minisgl_core.sampling import SamplingParams
from minisgl_core.step import DecodeEntries, ReqPlan, StepPlan
from minisgl_worker.attention.flashinfer_backend import paged_kv_layout
from minisgl_worker.engine.batch import InvalidPlan, PlanBuilder

PS, SLOTS, PAGES, VOCAB = 4, 8, 64, 100
CPU = torch.device("cpu")


def _builder() -> PlanBuilder:
    return PlanBuilder(SLOTS, 16, PAGES, PS, 64, VOCAB, CPU)


def _start(b: PlanBuilder, slot: int, n: int, first_page: int) -> None:
    pages = list(range(first_page, first_page + -(-(n + 8) // PS)))
    plan = StepPlan(0, [ReqPlan(slot, slot, 0, [1] * n, 0, pages,
                                sampling=SamplingParams(temperature=0.0))])
    b.validate(plan)
    b.build(plan)


def test_decode_batch_padded_to_graph_size_with_dummy_rows() -> None:
    b = _builder()
    for slot, n in [(2, 5), (5, 9), (6, 3)]:
        _start(b, slot, n, first_page=slot * 6)
    plan = StepPlan(1, decodes=DecodeEntries([2, 5, 6], [2, 5, 6], [5, 9, 3], [0, 0, 0],
                                             [0, 0, 0]))
    step, _ = b.build(plan, graph_size=lambda n: 4 if n <= 4 else None)
    batch = step.batch
    assert batch.batch_size == batch.num_tokens == 4 and batch.is_decode
    assert batch.seq_lens_host == [6, 10, 4, 1] and batch.cache_lens_host == [5, 9, 3, 0]
    dummy = PAGES  # the pool's extra page
    assert batch.page_table_host[3].tolist() == [dummy] * batch.page_table_host.shape[1]
    assert batch.out_loc[3].item() == dummy * PS and batch.positions[3].item() == 0
    assert step.sample_rids == [2, 5, 6] and step.batch.sample_indices.tolist() == [0, 1, 2]
    assert step.decode_index.tolist() == [0, 1, 2]
    # FlashInfer's CSR layout: pages per row 2, 3, 1, 1 (the padding row: the dummy page).
    assert batch.kv_indptr_host.tolist() == [0, 2, 5, 6, 7]
    assert batch.kv_indices.tolist() == [12, 13, 30, 31, 32, 36, dummy]
    assert batch.kv_last_page_len_host.tolist() == [2, 2, 4, 1]
    # ... and the one the backend's own fallback derives from the batch's host mirrors.
    want = paged_kv_layout(batch)
    assert batch.kv_indptr_host.tolist() == want[0].tolist()
    assert batch.kv_indices.tolist() == want[1].tolist()
    assert batch.kv_last_page_len_host.tolist() == want[2].tolist()
    assert batch.qo_indptr_host.tolist() == [0, 1, 2, 3, 4]
    # The decode kernel's start order: longest row first, the padding row last.
    assert batch.decode_order.tolist() == [1, 0, 2, 3]


def test_mixed_batch_is_not_padded_and_layout_matches() -> None:
    b = _builder()
    _start(b, 0, 6, first_page=0)
    plan = StepPlan(1, [ReqPlan(1, 1, 0, [3, 4, 5], 0, [20, 21],
                                sampling=SamplingParams(temperature=0.0))])
    plan.decodes.add(0, 0, 6)
    b.validate(plan)
    step, writes = b.build(plan, graph_size=lambda n: 8)
    batch = step.batch
    assert batch.batch_size == 2 and not batch.is_decode and batch.num_tokens == 4
    assert step.input_ids.tolist()[1:] == [3, 4, 5]
    assert writes.tolist() == [[1, 1], [0, 1], [20, 21]]
    want = paged_kv_layout(batch)
    assert batch.kv_indices.tolist() == want[1].tolist()
    assert batch.kv_indptr_host.tolist() == want[0].tolist() == [0, 2, 3]
    assert batch.decode_order is None  # not a decode step


def _random_plan(rng: random.Random, b: PlanBuilder) -> StepPlan:
    """Mostly valid plans, with one field pushed out of range now and then."""
    reqs, decodes = [], []
    for slot in rng.sample(range(SLOTS), rng.randint(1, 4)):
        if b.has_future[slot] and rng.random() < 0.6:
            decodes.append([slot, slot, rng.randint(0, 12), int(b.pages_len[slot]),
                            rng.sample(range(PAGES), rng.randint(0, 1))])
        else:
            n = rng.randint(1, 6)
            reqs.append(ReqPlan(slot, slot, 0, [rng.randrange(VOCAB) for _ in range(n)], 0,
                                rng.sample(range(PAGES), -(-n // PS) + rng.randint(0, 1)),
                                sampling=SamplingParams(temperature=0.0)))
    if rng.random() < 0.5 and reqs:
        r = rng.choice(reqs)
        field, value = rng.choice([("slot", SLOTS), ("slot", -1), ("cache_len", -1),
                                   ("cache_len", 70), ("page_offset", 15),
                                   ("input_ids", [VOCAB]), ("input_ids", []),
                                   ("new_pages", [PAGES]), ("history_ids", [-1])])
        setattr(r, field, value)
    elif rng.random() < 0.5 and decodes:
        d = rng.choice(decodes)
        i, value = rng.choice([(1, SLOTS), (1, -1), (2, -1), (2, 70), (3, 15), (4, [PAGES])])
        d[i] = value
    if rng.random() < 0.1:
        if reqs:
            reqs.append(reqs[0])  # a slot twice
        else:
            decodes.append(decodes[0])
    plan = StepPlan(1, reqs)
    for rid, slot, cache_len, offset, pages in decodes:
        plan.decodes.add(rid, slot, cache_len, offset, pages)
    if rng.random() < 0.05 and decodes:
        plan.decodes.new_page_counts[0] += 1  # counts that do not add up
    return plan


@pytest.mark.parametrize("seed", range(4))
def test_fast_validation_never_accepts_what_the_walk_refuses(seed: int) -> None:
    rng = random.Random(seed)
    b = _builder()
    refused = 0
    for _ in range(300):
        plan = _random_plan(rng, b)
        try:
            b._validate_each(plan)
            walk_ok = True
        except InvalidPlan:
            walk_ok, refused = False, refused + 1
        assert b._plan_ok(plan) == walk_ok
        if walk_ok:
            b.build(plan)
    assert refused > 20  # the generator does produce bad plans
    assert np.all(b.pages_len >= 0)


@pytest.mark.parametrize("prompt_lens", [[1], [3, 5], [2, 7, 1], [9, 4, 6, 1, 2]])
def test_uploaded_pieces_start_16_byte_aligned(prompt_lens: list[int]) -> None:
    """Every metadata tensor of a step starts on a 16-byte boundary whatever the batch's sizes
    (Triton compiles a kernel variant per pointer alignment: pieces packed end to end moved it
    with the sizes, and a GPU server compiled a second prefill-attention variant mid-run)."""
    b = _builder()
    reqs = []
    for slot, n in enumerate(prompt_lens):
        pages = list(range(slot * 6, slot * 6 + -(-(n + 8) // PS)))
        reqs.append(ReqPlan(slot, slot, 0, [1] * n, 0, pages,
                            sampling=SamplingParams(temperature=0.0)))
    plan = StepPlan(0, reqs)
    b.validate(plan)
    step, _ = b.build(plan)
    tensors = [v for v in vars(step.batch).values() if isinstance(v, torch.Tensor)]
    tensors += [v for v in vars(step).values() if isinstance(v, torch.Tensor)]
    device_side = [t for t in tensors if t.dtype in (torch.int32, torch.int64) and t.numel()]
    assert len(device_side) >= 8
    assert all(t.data_ptr() % 16 == 0 for t in device_side), [
        (t.dtype, t.shape, t.data_ptr() % 16) for t in device_side if t.data_ptr() % 16]
    # and the values are those of the parts, not of the padding between them
    n = sum(prompt_lens)
    assert step.batch.positions.tolist() == [i for p in prompt_lens for i in range(p)]
    assert step.batch.extend_lens.tolist() == prompt_lens and step.batch.num_tokens == n
