"""The sampler's per-slot state by name (sampling/params.py, state.py, plan.py): every parameter
is its own view of the packed tables, written and uploaded by row."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from minisgl_core.sampling import SamplingParams
from minisgl_worker.sampling import Sampler
from minisgl_worker.sampling.params import ParamRow, SlotParams
from minisgl_worker.sampling.plan import SamplingPlan
from minisgl_worker.sampling.state import SlotState

CPU = torch.device("cpu")
NAMES = [f.name for f in dataclasses.fields(ParamRow)]


def _distinct_row() -> ParamRow:
    """Every parameter a different value, so a name reading the wrong column shows."""
    return ParamRow(temperature=0.5, top_p=0.25, min_p=0.125, repetition_penalty=1.5,
                    presence_penalty=0.75, frequency_penalty=-0.5, draw_temperature=0.375,
                    top_k=7, seed=2**62 + 11, min_tokens=3, logprobs=1, top_logprobs=4)


def test_every_name_reads_its_own_column_on_host_numpy_and_device() -> None:
    state = SlotState(4, CPU)
    row = _distinct_row()
    state.set(2, row, [9])
    assert state.flush() is not None
    for params in (state.host, state.host_np, state.device_params):
        for name in NAMES:
            got = getattr(params, name)[2].item()
            assert got == getattr(row, name), name
        # the other slots keep an unset slot's values
        for name in NAMES:
            assert getattr(params, name)[0].item() == getattr(ParamRow(), name), name


def test_names_are_views_of_the_packed_tables() -> None:
    """A write through the table shows through the name and back: one storage, so a row's
    upload is one copy per table whatever the number of parameters."""
    p = SlotParams.neutral(3)
    for name in NAMES:
        view = getattr(p, name)
        assert view.shape == (3,)
        table = p.floats if view.dtype == torch.float32 else p.ints
        assert view.untyped_storage().data_ptr() == table.untyped_storage().data_ptr(), name
    columns = {(getattr(p, n).dtype, getattr(p, n).storage_offset()) for n in NAMES}
    assert len(columns) == len(NAMES)  # no two names share a column


def test_rows_gathers_every_parameter_of_a_batch() -> None:
    state = SlotState(4, CPU)
    state.set(3, _distinct_row(), [])
    batch = state.host_np.rows(np.array([3, 0, 3]))
    assert batch.temperature.tolist() == [0.5, 0.0, 0.5]
    assert batch.seed.tolist() == [2**62 + 11, 0, 2**62 + 11]
    assert batch.top_p.tolist() == [0.25, 1.0, 0.25]


def test_param_row_of_a_request() -> None:
    """draw_temperature is 0 on greedy rows (temperature <= 0 or top_k == 1); top_logprobs only
    with logprobs."""
    sampled = ParamRow.of(SamplingParams(temperature=0.7, top_logprobs=3), seed=5)
    assert (sampled.draw_temperature, sampled.seed, sampled.top_logprobs) == (0.7, 5, 0)
    assert ParamRow.of(SamplingParams(temperature=0.7, top_k=1), 0).draw_temperature == 0.0
    assert ParamRow.of(SamplingParams(temperature=0.0), 0).draw_temperature == 0.0
    lp = ParamRow.of(SamplingParams(logprobs=True, top_logprobs=3), 0)
    assert (lp.logprobs, lp.top_logprobs) == (1, 3)


def test_flush_uploads_only_dirty_rows_and_widens_stop_ids() -> None:
    state = SlotState(3, CPU)
    assert state.flush() is None  # nothing dirty
    state.set(1, ParamRow(temperature=1.0), [4, 5, 6])
    state.device_out_len[1] = 7  # a restarted slot's count starts again
    idx = state.flush()
    assert idx is not None and idx.tolist() == [1]
    assert state.device_out_len.tolist() == [0, 0, 0]
    assert state.device_stop.tolist() == [[-1, -1, -1], [4, 5, 6], [-1, -1, -1]]
    assert not state.dirty
    state.set(0, ParamRow(temperature=2.0), [8])
    state.flush()
    assert state.device_params.temperature.tolist() == [2.0, 1.0, 0.0]
    assert state.device_stop[0].tolist() == [8, -1, -1]


def test_plan_reads_the_named_parameters() -> None:
    state = SlotState(3, CPU)
    state.set(0, ParamRow.of(SamplingParams(temperature=0.8, top_p=0.9), 1), [])
    state.set(1, ParamRow.of(SamplingParams(temperature=0.0, min_tokens=2), 1), [])
    state.set(2, ParamRow.of(SamplingParams(temperature=0.8, top_k=40), 1), [])
    out_len = state.host_out_len_np
    plan = SamplingPlan.make(state.host_np.rows(np.array([0, 1])), out_len[[0, 1]], 100)
    assert (plan.all_greedy, plan.any_greedy, plan.top_p, plan.min_tokens, plan.max_k) == (
        False, True, True, True, 0)
    assert not plan.fused
    only_k = SamplingPlan.make(state.host_np.rows(np.array([2])), out_len[[2]], 30)
    assert (only_k.max_k, only_k.top_p) == (30, False)  # top_k capped at the vocabulary
    greedy = SamplingPlan.make(state.host_np.rows(np.array([1])), np.array([2]), 100)
    assert greedy.fused and greedy.all_greedy  # min_tokens reached


def test_a_refused_request_leaves_its_slot_as_it_was() -> None:
    sampler = Sampler(2, 10, CPU, seed=0)
    sampler.set_slot(1, SamplingParams(temperature=0.5, seed=3))
    before = sampler.slots.host.floats[1].clone(), sampler.slots.host.ints[1].clone()
    with pytest.raises(ValueError, match="logit_bias"):
        sampler.set_slot(1, SamplingParams(temperature=0.9, logit_bias={10: 1.0}))
    assert sampler.slots.host.floats[1].tolist() == before[0].tolist()
    assert sampler.slots.host.ints[1].tolist() == before[1].tolist()
    assert not sampler.biases.active[1]
