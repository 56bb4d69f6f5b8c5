"""The gateway's per-token path in process, without upstreams: scheduler steps through the pipeline
into request sinks, and text deltas into SSE bytes. These pieces were rewritten for speed (no
per-token JSON dicts, no list copies of the scheduler's fields, one wake-up per stream and step);
the tests pin that what comes out is what the straightforward code produced."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from minisgl_core.proto.minisgl.v1 import (
    common_pb2,
    detokenizer_pb2,
    generation_pb2,
    scheduler_pb2,
)
from minisgl_gateway.api.generation import ChoiceChunk, TokenLogprob
from minisgl_gateway.api.grpc_format import fill_choice
from minisgl_gateway.api.openai_format import Formatter
from minisgl_gateway.upstream.pipeline import Pipeline
from minisgl_gateway.upstream.scheduler_link import SchedulerLink
from minisgl_gateway.upstream.sequence import EventSink, StepEvent

LENGTH = common_pb2.FINISH_REASON_LENGTH
TEXTS = [" hello", "x", 'quote " backslash \\ slash /', "tab\t newline\n nul\x00 unit\x1f",
         "é ü 中文 🎉👨‍👩‍👧", "\u2028\u2029 \ud7ff\ue000\uffff", "}]{[,:", "a" * 5000]


def _generic_chunk(fmt: Formatter, index: int, text: str, include_usage: bool) -> bytes:
    """The chunk as a dict through json.dumps: the reference for the templated fast path."""
    item: dict[str, Any] = {"index": index}
    if fmt.kind == "chat":
        item["delta"] = {"content": text}
    else:
        item["text"] = text
    item["logprobs"], item["finish_reason"] = None, None
    return fmt._chunk([item], include_usage)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [True, False])
def test_text_chunks_are_byte_identical_to_json_dumps(kind: str, include_usage: bool) -> None:
    fmt = Formatter(kind, 'mo"del\\ é')
    for index in (0, 3, 15):
        for text in TEXTS:
            fast = fmt.stream_chunks([ChoiceChunk(index, text)], False, include_usage)
            assert fast == [_generic_chunk(fmt, index, text, include_usage)]
            body = json.loads(fast[0].decode()[len("data: "):])
            got = body["choices"][0]["delta"]["content"] if kind == "chat" else \
                body["choices"][0]["text"]
            assert got == text and ("usage" in body) == include_usage
    # Nothing visible: no chunk at all, as before.
    assert fmt.stream_chunks([ChoiceChunk(0, "")], False, include_usage) == []


def test_event_sink_takes_everything_in_order_with_one_waiter() -> None:
    async def main() -> None:
        sink = EventSink()
        sink.put(StepEvent(0, "a"))
        sink.put(StepEvent(1, "b"))
        assert [e.text for e in await sink.take()] == ["a", "b"] and sink.empty()
        waiting = asyncio.create_task(sink.take())
        await asyncio.sleep(0)
        sink.put(StepEvent(0, "c"))
        sink.put(StepEvent(0, "d"))  # arrives before the taker runs: same batch
        assert [e.text for e in await waiting] == ["c", "d"]
        # A cancelled take loses nothing: the next take gets what came meanwhile.
        waiting = asyncio.create_task(sink.take())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        sink.put(StepEvent(0, "e"))
        assert [e.text for e in await sink.take()] == ["e"]

    asyncio.run(main())


class _FakeDetokCall:
    def __init__(self) -> None:
        self.sent: list[detokenizer_pb2.DetokenizeRequest] = []

    async def write(self, request: detokenizer_pb2.DetokenizeRequest) -> None:
        self.sent.append(request)


def _pipeline() -> tuple[Pipeline, SchedulerLink, _FakeDetokCall]:
    """A pipeline with one engine whose stream counts as open, and a fake detokenizer stream."""
    pipe = Pipeline("127.0.0.1:1", grpc.aio.insecure_channel("127.0.0.1:1"),
                    channel_for=grpc.aio.insecure_channel)
    pipe._set_engines(["127.0.0.1:1"])  # not started: no stream is opened
    engine = pipe.links["127.0.0.1:1"]
    engine.view.up = True
    call = _FakeDetokCall()
    pipe.detok._call = call  # type: ignore[assignment]
    return pipe, engine, call


def _wire(message: Any) -> Any:
    """As the peer would see it: through bytes."""
    return type(message).FromString(message.SerializeToString())


def test_pipeline_step_to_events() -> None:
    """Three sequences over three steps: plain tokens, a stop string that ends one mid-update
    (its tokens and logprobs cut at the stop), and a final update with a finish reason."""

    async def main() -> None:
        pipe, engine, call = _pipeline()
        sinks = [EventSink() for _ in range(3)]
        stop = common_pb2.StopConditions(stop=["END"])
        seqs = [pipe.submit([1, 2], common_pb2.SamplingParams(), stop, i, sinks[i])
                for i in range(3)]
        engine._submits.clear()
        top = common_pb2.TopLogprobs(token_ids=[9], logprobs=[-0.5])

        def update(i: int, ids: list[int], finish: int = 0) -> scheduler_pb2.TokenUpdate:
            return scheduler_pb2.TokenUpdate(
                rid=seqs[i].rid, token_ids=ids, logprobs=[-0.1 * t for t in ids],
                top_logprobs=[top] * len(ids), finish_reason=finish, cached_tokens=1)

        async def step(updates: list[scheduler_pb2.TokenUpdate],
                       deltas: list[detokenizer_pb2.TextDelta]) -> detokenizer_pb2.DetokenizeRequest:
            await pipe._on_step(engine, _wire(scheduler_pb2.ConnectResponse(updates=updates)))
            request = _wire(call.sent.pop())
            pipe.detok._on_deltas(_wire(detokenizer_pb2.DetokenizeResponse(deltas=deltas)))
            return request

        first = await step([update(0, [5]), update(1, [6, 7]), update(2, [8])],
                           [detokenizer_pb2.TextDelta(rid=s.rid, text=t)
                            for s, t in zip(seqs, ["a", "bc", "d"], strict=True)])
        # The stop conditions ride on each sequence's first update only.
        assert [u.HasField("stop") for u in first.updates] == [True] * 3
        assert [list(u.token_ids) for u in first.updates] == [[5], [6, 7], [8]]
        assert [u.finished for u in first.updates] == [False] * 3
        second = await step(
            [update(0, [10]), update(1, [11, 12, 13]), update(2, [14], LENGTH)],
            [detokenizer_pb2.TextDelta(rid=seqs[0].rid, text="e"),
             detokenizer_pb2.TextDelta(rid=seqs[1].rid, text="f", stopped=True,
                                       matched_stop="END", num_tokens=3),
             detokenizer_pb2.TextDelta(rid=seqs[2].rid, text="g")])
        assert [u.HasField("stop") for u in second.updates] == [False] * 3
        assert [u.finished for u in second.updates] == [False, False, True]

        events = [await s.take() for s in sinks]
        plain = [(e.text, list(e.token_ids), list(e.logprobs), len(e.top_logprobs),
                  e.finish_reason, e.matched_stop, e.cached_tokens) for e in events[0]]
        assert plain == [("a", [5], [-0.5], 1, None, "", 1),
                         ("e", [10], [-1.0], 1, None, "", 1)]
        stopped = events[1][-1]
        # 2 tokens were delivered before; the match needed the 3rd: one of this update's three.
        assert (stopped.text, list(stopped.token_ids), stopped.finish_reason,
                stopped.matched_stop) == ("f", [11], "stop", "END")
        assert list(stopped.logprobs) == pytest.approx([-1.1]) and len(stopped.top_logprobs) == 1
        assert seqs[1].done and seqs[1].rid in engine._stops  # stopped upstream with the next send
        last = events[2][-1]
        assert (last.text, list(last.token_ids), last.finish_reason) == ("g", [14], "length")
        assert seqs[2].rid not in engine.live and not seqs[2].detok_started

        # The stopped sequence's later updates only flush the detokenizer at its very end.
        third = await step([update(0, [15]), update(1, [16], LENGTH)],
                           [detokenizer_pb2.TextDelta(rid=seqs[0].rid, text="h"),
                            detokenizer_pb2.TextDelta(rid=seqs[1].rid)])
        assert [(list(u.token_ids), u.finished) for u in third.updates] == [([15], False),
                                                                              ([], True)]
        assert [e.text for e in await sinks[0].take()] == ["h"] and sinks[1].empty()
        assert not seqs[1].detok_started and seqs[1].rid not in engine.live

    asyncio.run(main())


def test_grpc_choices_are_filled_like_constructed_ones() -> None:
    def constructed(chunk: ChoiceChunk) -> generation_pb2.Choice:
        choice = generation_pb2.Choice(index=chunk.index, text=chunk.text,
                                       token_ids=chunk.token_ids, matched_stop=chunk.matched_stop)
        if chunk.finish_reason:
            choice.finish_reason = {"stop": common_pb2.FINISH_REASON_STOP,
                                    "length": LENGTH}[chunk.finish_reason]
        for t in chunk.logprobs:
            choice.logprobs.append(generation_pb2.TokenLogprob(
                token_id=t.token_id, token=t.token, logprob=t.logprob,
                top_token_ids=[i for i, _, _ in t.top], top_tokens=[s for _, s, _ in t.top],
                top_logprobs=[p for _, _, p in t.top]))
        return choice

    ids = scheduler_pb2.TokenUpdate(token_ids=[4, 5]).token_ids  # as the pipeline passes them
    lp = [TokenLogprob(4, "a", -0.5, [(4, "a", -0.5), (9, "b", -2.0)]), TokenLogprob(5, "c", -1)]
    for chunk in [ChoiceChunk(0, "ab", ids), ChoiceChunk(2, "", [], [], "length"),
                  ChoiceChunk(1, "x", [7], lp, "stop", "END"), ChoiceChunk(0)]:
        reply = generation_pb2.GenerateResponse()
        fill_choice(reply.choices.add(), chunk)
        assert reply.choices[0] == constructed(chunk)
