"""Resumed requests (migrated off a lost engine): the prompt / earlier-output split, the output
budget left, and a resumed run continuing exactly where the first one stopped."""

from __future__ import annotations

import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2, scheduler_pb2
from minisgl_core.sampling import SamplingParams
from minisgl_scheduler import FinishReason, InvalidRequest, Scheduler, SchedulerConfig
from minisgl_scheduler.admission import resume_split
from minisgl_scheduler.server import _batch

from .fake_executor import FakeExecutor, reference
from .helpers import assert_all_pages_back, run

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def make(**kw: object) -> tuple[FakeExecutor, Scheduler]:
    fake = FakeExecutor(**kw)  # type: ignore[arg-type]
    return fake, Scheduler(fake, SchedulerConfig(disable_overlap=True))


def test_split_defaults_to_all_prompt() -> None:
    params = SamplingParams(max_tokens=4)
    assert resume_split(PROMPT, params, 0) == len(PROMPT)
    assert resume_split(PROMPT, params, 5) == 5
    assert resume_split(PROMPT, params, len(PROMPT)) == len(PROMPT)


def test_split_refuses_impossible_resumes() -> None:
    with pytest.raises(InvalidRequest, match="exceeds"):
        resume_split(PROMPT, SamplingParams(max_tokens=4), len(PROMPT) + 1)
    with pytest.raises(InvalidRequest, match="nothing is left"):
        resume_split(PROMPT, SamplingParams(max_tokens=2), len(PROMPT) - 2)


@pytest.mark.parametrize("done", [1, 3, 9])
def test_resumed_request_continues_the_same_output(done: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    fake, s = make()
    want = reference(PROMPT, params, fake)
    assert len(want) == 12
    s.submit(1, PROMPT + want[:done], params, num_prompt_tokens=len(PROMPT))
    req = s.reqs[1]
    assert (req.prompt_len, req.num_outputs, req.max_tokens) == (len(PROMPT), done, 12)
    rec = run(s)
    # Only the outputs left, ending at the same total length (max_tokens counts the earlier ones).
    assert rec.out[1].tokens == want[done:]
    assert rec.out[1].finish is FinishReason.LENGTH
    assert_all_pages_back(s)


def test_resumed_request_reports_the_original_prompt() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    fake, s = make()
    want = reference(PROMPT, params, fake)
    s.submit(1, PROMPT + want[:2], params, num_prompt_tokens=len(PROMPT))
    events = []
    while s.has_work():
        events += s.step()
    assert events and all(ev.prompt_tokens in (0, len(PROMPT)) for ev in events)
    assert any(ev.prompt_tokens == len(PROMPT) for ev in events)
    assert all(ev.cached_tokens <= len(PROMPT) for ev in events)


def test_min_tokens_counts_earlier_outputs() -> None:
    # With EOS frequent, a min_tokens request resumed after `done` outputs must still hold back
    # EOS until min_tokens outputs in total, no more.
    params = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=6)
    fake, s = make(eos_every=2)
    want = reference(PROMPT, params, fake)
    s.submit(1, PROMPT + want[:3], params, num_prompt_tokens=len(PROMPT))
    rec = run(s)
    assert want[:3] + rec.out[1].tokens == want


def test_window_counts_from_the_prompt() -> None:
    # The context window holds prompt + every output: a resumed request stops where it would.
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    fake, s = make(max_model_len=16, num_pages=64)
    want = reference(PROMPT, params, fake)
    assert len(want) == 16 - len(PROMPT)
    s.submit(1, PROMPT + want[:4], params, num_prompt_tokens=len(PROMPT))
    rec = run(s)
    assert want[:4] + rec.out[1].tokens == want
    assert rec.out[1].finish is FinishReason.LENGTH


def test_the_proto_field_reaches_the_submit() -> None:
    msg = scheduler_pb2.ConnectRequest(submits=[
        scheduler_pb2.SubmitItem(rid=1, input_ids=[1, 2, 3, 4], num_prompt_tokens=3,
                                 sampling=common_pb2.SamplingParams(max_tokens=5)),
        scheduler_pb2.SubmitItem(rid=2, input_ids=[1, 2])])
    first, second = _batch(None, msg, 16).submits  # type: ignore[arg-type]
    assert (first.input_ids, first.num_prompt_tokens) == ([1, 2, 3, 4], 3)
    assert second.num_prompt_tokens == 0  # not set: all prompt
