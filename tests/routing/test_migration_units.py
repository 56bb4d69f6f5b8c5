"""The gateway's side of migration without processes: the resumed submit, the seed it fixes, and
the pipeline's rules (engines whose worker is down, what an attempt is, how a stream gives up)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2, detokenizer_pb2, scheduler_pb2
from minisgl_gateway.errors import ApiError
from minisgl_gateway.upstream.migration import MigrationPolicy, fix_seed, resume_item
from minisgl_gateway.upstream.pipeline import Pipeline
from minisgl_gateway.upstream.routing import Router
from minisgl_gateway.upstream.scheduler_link import SchedulerLink
from minisgl_gateway.upstream.sequence import EventSink, Sequence


def test_resume_item_appends_the_outputs_and_marks_the_prompt() -> None:
    item = scheduler_pb2.SubmitItem(rid=7, input_ids=[1, 2, 3], cache_salt="s",
                                    sampling=common_pb2.SamplingParams(max_tokens=9, seed=4))
    resumed = resume_item(item, [10, 11])
    assert list(resumed.input_ids) == [1, 2, 3, 10, 11]
    assert resumed.num_prompt_tokens == 3
    assert (resumed.rid, resumed.cache_salt, resumed.sampling.seed) == (7, "s", 4)
    assert list(item.input_ids) == [1, 2, 3] and item.num_prompt_tokens == 0  # untouched
    # A second move resumes from the original prompt with every output so far.
    again = resume_item(item, [10, 11, 12])
    assert list(again.input_ids) == [1, 2, 3, 10, 11, 12] and again.num_prompt_tokens == 3


def test_fix_seed_only_for_unseeded_sampling() -> None:
    seeded = common_pb2.SamplingParams(temperature=0.7, seed=5)
    fix_seed(seeded)
    assert seeded.seed == 5
    greedy = common_pb2.SamplingParams(temperature=0.0)
    fix_seed(greedy)
    assert not greedy.HasField("seed")
    for sampled in (common_pb2.SamplingParams(temperature=0.7), common_pb2.SamplingParams()):
        fix_seed(sampled)  # no temperature: the default 1.0 samples
        assert sampled.HasField("seed") and 0 <= sampled.seed < 2**62


def test_policy_switch() -> None:
    assert MigrationPolicy().enabled
    assert not MigrationPolicy(attempts=0).enabled


# -- the pipeline's migration rules, in process (fake engines and detokenizer) -------------------

A, B = "127.0.0.1:1", "127.0.0.1:2"
UNAVAILABLE = common_pb2.Error(code=common_pb2.ERROR_CODE_UNAVAILABLE,
                               message="the worker failed: the worker stream broke")


class _Detok:
    """The detokenizer stream: records each request; `answer` replies to all of them in order."""

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe = pipe
        self.sent: list[detokenizer_pb2.DetokenizeRequest] = []
        self.answered = 0

    async def write(self, request: detokenizer_pb2.DetokenizeRequest) -> None:
        self.sent.append(request)

    def answer(self) -> None:
        for request in self.sent[self.answered:]:
            self.pipe.detok._on_deltas(detokenizer_pb2.DetokenizeResponse(deltas=[
                detokenizer_pb2.TextDelta(rid=u.rid, text=f"<{len(u.token_ids)}>")
                for u in request.updates]))
        self.answered = len(self.sent)


def _pipeline(engines: list[str], attempts: int = 2,
              wait_s: float = 10.0) -> tuple[Pipeline, dict[str, SchedulerLink], _Detok]:
    pipe = Pipeline(",".join(engines), grpc.aio.insecure_channel(A),
                    channel_for=grpc.aio.insecure_channel, router=Router("least_load"),
                    migration=MigrationPolicy(attempts, wait_s))
    pipe._set_engines(engines)  # not started: no stream is opened
    for link in pipe.links.values():
        link.view.up = True
    detok = _Detok(pipe)
    pipe.detok._call = detok  # type: ignore[assignment]
    return pipe, pipe.links, detok


async def _step(pipe: Pipeline, detok: _Detok, link: SchedulerLink,
                *updates: scheduler_pb2.TokenUpdate) -> None:
    await pipe.detok.on_step(link, scheduler_pb2.ConnectResponse(updates=updates))
    detok.answer()


def _report(link: SchedulerLink, worker_down: bool) -> None:
    assert link.view.apply(scheduler_pb2.WatchResponse(
        load=scheduler_pb2.EngineLoad(worker_down=worker_down)))


def _taken(link: SchedulerLink) -> list[scheduler_pb2.SubmitItem]:
    items, link._submits = link._submits, []
    return items


def _submit(pipe: Pipeline, sink: EventSink) -> Sequence:
    return pipe.submit([1, 2, 3], common_pb2.SamplingParams(temperature=0.0, max_tokens=50),
                       common_pb2.StopConditions(), 0, sink)


def test_routing_skips_an_engine_whose_scheduler_reports_its_worker_down() -> None:
    async def main() -> None:
        pipe, links, _ = _pipeline([A, B])
        links[B].view.inflight = 5
        links[B].view.load = scheduler_pb2.EngineLoad(running_requests=5)
        _report(links[A], worker_down=True)  # idle, so least loaded, but its worker is gone
        assert not links[A].view.usable and links[B].view.usable
        for _ in range(3):
            seq = _submit(pipe, EventSink())
            assert seq.link is links[B]
        _report(links[A], worker_down=False)  # back
        assert _submit(pipe, EventSink()).link is links[A]
        _report(links[B], worker_down=True)
        _report(links[A], worker_down=True)
        with pytest.raises(ApiError) as err:  # nothing to route to: a clear 503, no hang
            _submit(pipe, EventSink())
        assert err.value.status == 503

    asyncio.run(main())


def test_a_stream_whose_worker_died_waits_for_it_instead_of_bouncing_off_it() -> None:
    """One engine: its worker dies mid-stream. The stream is parked while the engine says (or
    the gateway just saw) that the worker is down, however often the gateway looks, and resumes,
    once, when the worker is back: no attempt is spent on an engine that cannot take it."""

    async def main() -> None:
        pipe, links, detok = _pipeline([A], attempts=1)
        sink = EventSink()
        seq = _submit(pipe, sink)
        _taken(links[A])
        await _step(pipe, detok, links[A], scheduler_pb2.TokenUpdate(rid=seq.rid,
                                                                     token_ids=[7, 8]))
        await _step(pipe, detok, links[A], scheduler_pb2.TokenUpdate(
            rid=seq.rid, finish_reason=common_pb2.FINISH_REASON_ERROR, error=UNAVAILABLE))
        assert seq.rid in pipe.parked and not seq.done
        for _ in range(5):  # the failure alone holds the engine back, before any report
            pipe._place_parked(time.monotonic())
            assert seq.rid in pipe.parked and not _taken(links[A])
        links[A].view.held_until = 0.0  # the hold ran out; the reports say what is true
        _report(links[A], worker_down=True)
        for _ in range(5):
            pipe._place_parked(time.monotonic())
            assert seq.rid in pipe.parked and not _taken(links[A])
        _report(links[A], worker_down=False)
        pipe._place_parked(time.monotonic())
        assert seq.rid not in pipe.parked
        [resumed] = _taken(links[A])
        assert list(resumed.input_ids) == [1, 2, 3, 7, 8] and resumed.num_prompt_tokens == 3
        await _step(pipe, detok, links[A], scheduler_pb2.TokenUpdate(
            rid=seq.rid, token_ids=[9], finish_reason=common_pb2.FINISH_REASON_LENGTH))
        events = await sink.take()
        assert events[-1].finish_reason == "length" and events[-1].error is None
        assert seq.outputs == [7, 8, 9]

    asyncio.run(main())


def test_attempts_count_only_moves_without_progress() -> None:
    """attempts=1: a resumed stream that made tokens before its next engine failed moves again;
    one that fails again without a new token ends, with the engine's error, at once."""

    async def main() -> None:
        pipe, links, detok = _pipeline([A, B], attempts=1)
        sink = EventSink()
        seq = _submit(pipe, sink)
        first = seq.link
        assert isinstance(first, SchedulerLink)
        other = links[B] if first is links[A] else links[A]
        _taken(first)
        await _step(pipe, detok, first, scheduler_pb2.TokenUpdate(rid=seq.rid, token_ids=[7]))
        await _step(pipe, detok, first, scheduler_pb2.TokenUpdate(
            rid=seq.rid, finish_reason=common_pb2.FINISH_REASON_ERROR, error=UNAVAILABLE))
        assert seq.link is other and list(_taken(other)[0].input_ids) == [1, 2, 3, 7]
        first.view.held_until = 0.0  # its worker is back
        # Progress on the second engine, then it fails too: moves again despite attempts=1.
        await _step(pipe, detok, other, scheduler_pb2.TokenUpdate(rid=seq.rid, token_ids=[8]))
        await _step(pipe, detok, other, scheduler_pb2.TokenUpdate(
            rid=seq.rid, token_ids=[9], finish_reason=common_pb2.FINISH_REASON_ERROR,
            error=UNAVAILABLE))
        assert seq.link is first and list(_taken(first)[0].input_ids) == [1, 2, 3, 7, 8, 9]
        assert seq.migrations == 1 and not seq.done
        # No progress before the next failure: that move is not made; the stream ends clearly.
        await _step(pipe, detok, first, scheduler_pb2.TokenUpdate(
            rid=seq.rid, finish_reason=common_pb2.FINISH_REASON_ERROR, error=UNAVAILABLE))
        events = [e for batch in [await sink.take()] for e in batch]
        assert seq.done and events[-1].finish_reason == "error"
        assert events[-1].error is not None and "worker" in events[-1].error.message
        assert not pipe.parked and not _taken(other)

    asyncio.run(main())


def test_a_stream_no_engine_takes_ends_with_an_error_after_the_wait() -> None:
    async def main() -> None:
        pipe, links, detok = _pipeline([A], wait_s=0.2)
        sink = EventSink()
        seq = _submit(pipe, sink)
        await _step(pipe, detok, links[A], scheduler_pb2.TokenUpdate(rid=seq.rid, token_ids=[7]))
        await _step(pipe, detok, links[A], scheduler_pb2.TokenUpdate(
            rid=seq.rid, finish_reason=common_pb2.FINISH_REASON_ERROR, error=UNAVAILABLE))
        _report(links[A], worker_down=True)
        pipe._place_parked(time.monotonic())
        assert seq.rid in pipe.parked
        pipe._place_parked(time.monotonic() + 1.0)  # past the wait: flushed, then failed
        assert not pipe.parked
        await asyncio.sleep(0)  # the flush goes out
        detok.answer()
        events = []
        while not seq.done or not sink.empty():
            events += await asyncio.wait_for(sink.take(), 5)
        assert events[-1].finish_reason == "error" and events[-1].error is not None
        assert "no engine took the stream over" in events[-1].error.message

    asyncio.run(main())
