"""Admission control, request lifecycle edges, aborts in every state, worker failures."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from minisgl_core.sampling import SamplingParams
from minisgl_scheduler import (
    ContextLengthExceeded,
    ErrorCode,
    FinishReason,
    InvalidRequest,
    Overloaded,
    Scheduler,
    SchedulerConfig,
)

from .fake_executor import FakeExecutor, reference
from .helpers import Recorder, assert_all_pages_back, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def make(overlap: bool = False, **kw: object) -> tuple[FakeExecutor, Scheduler]:
    fake_kw = {k: kw.pop(k) for k in list(kw) if k in (
        "num_pages", "page_size", "max_slots", "max_model_len", "eos_every", "fail_at_step")}
    fake = FakeExecutor(**fake_kw)  # type: ignore[arg-type]
    return fake, Scheduler(fake, SchedulerConfig(disable_overlap=not overlap, **kw))  # type: ignore[arg-type]


def test_queue_overflow_is_overloaded() -> None:
    _, s = make(max_queued_requests=3)
    for rid in range(3):
        s.submit(rid, [1, 2, 3], GREEDY)
    with pytest.raises(Overloaded) as err:
        s.submit(3, [1, 2, 3], GREEDY)
    assert err.value.code is ErrorCode.OVERLOADED and "queue is full" in err.value.message
    s.step()  # admitted requests leave the queue: room again
    s.submit(3, [1, 2, 3], GREEDY)


def test_context_length_checks() -> None:
    fake, s = make(max_model_len=32, num_pages=64)
    with pytest.raises(ContextLengthExceeded, match="context window is 32 tokens"):
        s.submit(0, [1] * 32, GREEDY)  # prompt + 1 output > 32
    with pytest.raises(ContextLengthExceeded) as err:
        s.submit(0, [1] * 100, GREEDY)
    assert err.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and "100 tokens" in err.value.message
    # 31 prompt tokens leave room for exactly one output: max_tokens is clipped, finish "length".
    s.submit(1, [1] * 31, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    s.submit(2, [1] * 20, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    rec = run(s)
    assert len(rec.out[1].tokens) == 1 and rec.out[1].finish is FinishReason.LENGTH
    assert len(rec.out[2].tokens) == 12 and rec.out[2].finish is FinishReason.LENGTH
    assert_all_pages_back(s)


def test_prompt_larger_than_the_pool_is_refused() -> None:
    _, s = make(num_pages=4, page_size=4, max_model_len=1000)
    with pytest.raises(ContextLengthExceeded, match="KV cache holds only 16 tokens"):
        s.submit(0, [1] * 17, GREEDY)


def test_request_that_can_never_fit_ends_with_an_error_not_a_loop() -> None:
    fake, s = make(num_pages=4, page_size=4, max_model_len=1000)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    s.submit(0, [1] * 10, params)
    s.submit(1, [2] * 3, SamplingParams(temperature=0.0, max_tokens=2))
    rec = run(s, max_steps=200)
    out = rec.out[0]
    assert out.finish is FinishReason.ERROR
    assert out.error is not None and out.error.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert "pool holds 4 pages" in out.error.message
    assert out.tokens == reference([1] * 10, params, fake)[: len(out.tokens)]
    assert len(out.tokens) == 16 - 10 + 1  # every token that fit was delivered
    assert rec.out[1].finish is FinishReason.LENGTH
    assert_all_pages_back(s)


@pytest.mark.parametrize("bad,msg", [
    (dict(input_ids=[]), "prompt is empty"),
    (dict(input_ids=[1, 5000]), "outside the vocabulary"),
    (dict(params=SamplingParams(temperature=-1.0)), "temperature"),
    (dict(params=SamplingParams(max_tokens=0)), "max_tokens"),
])
def test_invalid_requests(bad: dict, msg: str) -> None:
    _, s = make()
    args = dict(input_ids=[1, 2], params=GREEDY) | bad
    with pytest.raises(InvalidRequest, match=msg) as err:
        s.submit(0, args["input_ids"], args["params"])
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert not s.has_work()


def test_duplicate_live_rid_is_refused_and_reusable_after_the_end() -> None:
    _, s = make()
    s.submit(7, [1, 2], GREEDY)
    with pytest.raises(InvalidRequest, match="already in use"):
        s.submit(7, [1, 2], GREEDY)
    run(s)
    s.submit(7, [1, 2], GREEDY)


def _used(s: Scheduler) -> int:
    return s.stats().used_pages


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("state", ["queued", "prefilling", "decoding", "finished"])
def test_abort_in_each_state_frees_pages(state: str, overlap: bool) -> None:
    fake, s = make(overlap, num_pages=32, page_size=2, max_prefill_tokens=8)
    rec = Recorder()
    s.submit(0, list(range(1, 21)), SamplingParams(temperature=0.0, max_tokens=30,
                                                   ignore_eos=True))
    if state == "queued":
        assert s.abort(0)
        assert _used(s) == 0
    elif state == "prefilling":
        rec.add(s.step())  # first 8-token chunk of 20
        assert s.reqs[0].prefilling and _used(s) > 0
        assert s.abort(0)
    elif state == "decoding":
        for _ in range(5):
            rec.add(s.step())
        assert not s.reqs[0].prefilling and rec.out[0].tokens
        assert s.abort(0)
    else:
        run(s, rec)
        assert not s.abort(0)
    if state in ("prefilling", "decoding") and overlap:
        assert _used(s) > 0  # a launched step still references the pages ...
    else:
        assert _used(s) == 0  # ... otherwise they are back at once
    run(s, rec)  # ... and come back when it is collected
    if state != "finished":
        assert rec.out[0].finish is FinishReason.ABORT
    assert not s.abort(0)
    assert_all_pages_back(s)


def test_abort_with_reason_stop_and_no_token_after_abort() -> None:
    _, s = make(True)
    s.submit(0, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    rec = Recorder()
    for _ in range(4):
        rec.add(s.step())
    n = len(rec.out[0].tokens)
    assert s.abort(0, reason="stop")  # a stop string seen by the detokenizer
    rec.add(s.step())
    assert rec.out[0].finish is FinishReason.STOP and len(rec.out[0].tokens) == n
    run(s, rec)  # the in-flight token is dropped, not reported
    assert len(rec.out[0].tokens) == n
    assert_all_pages_back(s)


@pytest.mark.parametrize("overlap", [False, True])
def test_worker_failure_fails_requests_with_an_error_then_recovers(overlap: bool) -> None:
    fake, s = make(overlap, fail_at_step=3, num_pages=32)
    for rid in range(3):
        s.submit(rid, [rid + 1] * 5, SamplingParams(temperature=0.0, max_tokens=20))
    rec = run(s, max_steps=50)
    for rid in range(3):
        out = rec.out[rid]
        assert out.finish is FinishReason.ERROR and out.error is not None
        assert out.error.code is ErrorCode.UNAVAILABLE and "injected failure" in out.error.message
    assert_all_pages_back(s)
    fake.fail_at_step = None  # the worker is back
    s.submit(9, [4, 5, 6], GREEDY)
    rec = run(s)
    assert rec.out[9].tokens == reference([4, 5, 6], GREEDY, fake)


def test_min_tokens_and_stop_tokens() -> None:
    fake, s = make(eos_every=3)
    min_p = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6)
    plain = SamplingParams(temperature=0.0, max_tokens=20)
    # A prompt whose continuation hits EOS after a few tokens.
    prompt = next(p for k in range(200) if 1 < len(reference(p := [k, k + 1], plain, fake)) < 6)
    want = reference(prompt, plain, fake)
    stop_at = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                             stop_token_ids=[want[1]])
    s.submit(0, prompt, min_p)
    s.submit(1, prompt, plain)
    s.submit(2, prompt, stop_at)
    rec = run(s)
    assert rec.out[1].tokens == want and rec.out[1].finish is FinishReason.STOP
    assert rec.out[0].tokens == reference(prompt, min_p, fake)
    assert len(rec.out[0].tokens) >= 6  # EOS before the 6th token did not stop it
    assert rec.out[2].tokens == want[:2] and rec.out[2].finish is FinishReason.STOP


def test_logprobs_only_when_asked() -> None:
    _, s = make()
    s.submit(0, [1, 2], SamplingParams(temperature=0.0, max_tokens=3, logprobs=True,
                                       top_logprobs=2))
    s.submit(1, [1, 2], SamplingParams(temperature=0.0, max_tokens=3))
    events = []
    while s.has_work():
        events += s.step()
    asked = [e for e in events if e.rid == 0]
    assert sum(len(e.token_ids) for e in asked) == 3
    assert all(len(e.logprobs) == len(e.token_ids) == len(e.top_logprobs) for e in asked)
    assert all(not e.logprobs and not e.top_logprobs for e in events if e.rid == 1)


def test_chunked_prefill_budget_and_running_cap() -> None:
    fake, s = make(max_prefill_tokens=10, max_running_requests=3, num_pages=128)
    for rid in range(6):
        s.submit(rid, [rid + 1] * 23, GREEDY)
    run(s)
    for plan in fake.plans:
        prefill = [r for r in plan.reqs if r.input_ids]
        assert sum(len(r.input_ids) for r in prefill) <= 10
        assert plan.num_entries <= 3
        for r in prefill:  # a chunk that does not end the prompt samples nothing
            assert r.sample == (r.cache_len + len(r.input_ids) == 23)
    assert any(not r.sample for plan in fake.plans for r in plan.reqs)


@pytest.mark.parametrize("policy,first", [("fcfs", 1), ("lpm", 2)])
def test_lpm_admits_the_longest_cached_prefix_first(policy: str, first: int) -> None:
    fake, s = make(policy=policy, max_running_requests=1, num_pages=64, page_size=4)
    prefix = list(range(10, 42))
    s.submit(0, prefix + [1], GREEDY)
    run(s)  # the prefix is cached now
    s.submit(1, [3] * 33, GREEDY)
    s.submit(2, prefix + [2], GREEDY)
    s.step()
    assert [r.rid for r in fake.plans[-1].reqs] == [first]
    rec = run(s)
    assert rec.out[2].cached_tokens == 32
    assert rec.out[1].cached_tokens == 0


def test_stats_report_load() -> None:
    _, s = make(num_pages=64, page_size=2)
    s.submit(0, [1] * 10, GREEDY)
    s.submit(1, [1] * 10, GREEDY)
    st = s.stats()
    assert (st.running, st.waiting, st.used_pages, st.total_pages) == (0, 2, 0, 64)
    s.step()
    st = s.stats()
    assert st.running >= 1 and st.used_pages > 0 and 0 < st.kv_usage < 1
    run(s)
    st = s.stats()
    assert st.finished == 2 and st.cached_pages > 0 and st.prefix_hit_rate > 0


def test_preempted_request_restarts_with_its_outputs_counted() -> None:
    fake, s = make(num_pages=8, page_size=1, decode_reserve_ratio=0.0)
    a = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    b = SamplingParams(temperature=0.0, max_tokens=5, min_tokens=5, ignore_eos=True,
                       repetition_penalty=1.2)
    s.submit(0, [1, 2, 3], a)
    s.submit(1, [4, 5], b)
    rec = run(s)
    assert s.stats().preemptions >= 1
    starts = [r for plan in fake.plans for r in plan.reqs if r.rid == 1 and r.sampling]
    assert len(starts) >= 2 and starts[0].sampling.min_tokens == 5
    restart = starts[-1]
    done = len(restart.history_ids) + len(restart.input_ids) - 2  # outputs before the restart
    assert done > 0 and restart.sampling.min_tokens == 5 - done
    assert rec.out[1].tokens == reference([4, 5], b, fake)
    assert rec.out[0].tokens == reference([1, 2, 3], a, fake)


@pytest.mark.parametrize("tp, two_shot, chunk, warned", [
    (2, 8192 + 16, 8192, False),  # the worker's buffer covers a full step (16 slots)
    (2, 8192 + 16, 16384, True),  # a larger chunk than the worker was sized for
    (2, 0, 16384, False),  # no fused kernel at all (NCCL by choice, or an older worker)
    (1, 100, 16384, False),  # one GPU: no all-reduce
])
def test_a_chunk_past_the_workers_fused_all_reduce_is_logged(
        caplog: pytest.LogCaptureFixture, tp: int, two_shot: int, chunk: int,
        warned: bool) -> None:
    executor = FakeExecutor()
    executor._info = dataclasses.replace(executor.info(), tp_size=tp,
                                         two_shot_max_tokens=two_shot)
    with caplog.at_level(logging.WARNING, logger="minisgl_scheduler.scheduler"):
        Scheduler(executor, SchedulerConfig(max_prefill_tokens=chunk))
    logged = [r.getMessage() for r in caplog.records if "fused TP all-reduce" in r.getMessage()]
    assert bool(logged) == warned
    if warned:
        assert f"--max-prefill-tokens {chunk} too" in logged[0]
