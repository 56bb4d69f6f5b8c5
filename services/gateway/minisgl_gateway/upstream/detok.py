"""The detokenizer half of the pipeline: every engine's step becomes one DetokenizeRequest on the
one Detokenize stream, and each answer becomes the `StepEvent`s of its sequences.

    engine ──ConnectResponse──▶ on_step ──DetokenizeRequest──▶ Detokenizer ──TextDeltas──▶ here
    here ──StepEvent──▶ the sink of the request the rid belongs to

Answers come in request order, so the batches in flight are a FIFO. A sequence refused before
its first token with UNAVAILABLE (a draining engine) is handed to `retry` instead of failing; one
failed with UNAVAILABLE after its first tokens (the engine's worker died) to `migrate`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2_grpc
from minisgl_core.codes import ErrorCode, finish_name, proto_error
from minisgl_core.proto.minisgl.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
)

from minisgl_gateway.errors import ApiError, from_upstream, unavailable
from minisgl_gateway.upstream.scheduler_link import SchedulerLink
from minisgl_gateway.upstream.sequence import Sequence, StepEvent
from minisgl_gateway.upstream.streams import keep_open

log = logging.getLogger(__name__)

Batch = list[tuple[Sequence, scheduler_pb2.TokenUpdate | None]]


@dataclass(frozen=True)
class DetokHooks:
    abort: Callable[[Sequence, bool], None]  # (seq, stop): end it upstream
    retry: Callable[[Sequence, scheduler_pb2.TokenUpdate], bool]  # refused before any token
    # failed UNAVAILABLE after its first tokens (its worker died): continue elsewhere if it may
    migrate: Callable[[Sequence, SchedulerLink, scheduler_pb2.TokenUpdate], bool]


class Detokenizing:
    def __init__(self, channel: grpc.aio.Channel, hooks: DetokHooks, retry_after: int) -> None:
        self._stub = detokenizer_pb2_grpc.DetokenizerStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        self._hooks = hooks
        self._retry_after = retry_after
        self._call: grpc.aio.StreamStreamCall | None = None
        self._inflight: deque[Batch] = deque()
        self._lock = asyncio.Lock()  # one write at a time, in the order of _inflight
        self._flushes: set[asyncio.Task[None]] = set()
        self.closing = False
        self.started: Callable[[], list[Sequence]] = list  # live sequences with detok state

    @property
    def ready(self) -> bool:
        return self._call is not None

    async def run(self) -> None:
        await keep_open("detokenizer", self._health, self._stub.Detokenize, self._serve,
                        self._down, self._lost, lambda: self.closing)

    async def _serve(self, call: grpc.aio.StreamStreamCall) -> None:
        self._call = call
        async for response in call:
            self._on_deltas(response)

    def _down(self, call: grpc.aio.StreamStreamCall) -> bool:
        was_up, self._call = self._call is call, None
        return was_up

    def _lost(self, reason: str) -> None:
        error = unavailable(f"lost the connection to the detokenizer ({reason})",
                            self._retry_after)
        while self._inflight:
            self._fail_batch(self._inflight.popleft(), error)
        # The new stream starts without their incremental state: they cannot continue.
        self._fail_batch([(s, None) for s in self.started()], error)

    # -- engine steps ------------------------------------------------------------------------

    async def on_step(self, link: SchedulerLink, response: scheduler_pb2.ConnectResponse) -> None:
        # Hot path: runs for every token of every stream. The DetokenizeUpdates are added in
        # place (constructing each and copying it into the request cost twice as much), and
        # each repeated field is read once.
        batch: Batch = []
        request = detokenizer_pb2.DetokenizeRequest()
        add = request.updates.add
        live = link.live
        for update in response.updates:
            rid = update.rid
            seq = live.get(rid)
            if seq is None:
                continue
            finished = update.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
            if finished:
                del live[rid]
                link.reported_cached.inc(update.cached_tokens)
            if seq.done:  # dropped by the gateway: only flush the detokenizer at the very end
                if finished and seq.detok_started:
                    add(rid=rid, finished=True)
                    batch.append((seq, None))
                continue
            token_ids = update.token_ids
            seq.outputs.extend(token_ids)
            if (finished and seq.detok_started
                    and update.error.code == common_pb2.ERROR_CODE_UNAVAILABLE
                    and self._hooks.migrate(seq, link, update)):
                if token_ids:  # made before the failure: they still go out, unfinished
                    add(rid=rid, token_ids=token_ids)
                    batch.append((seq, scheduler_pb2.TokenUpdate(
                        rid=rid, token_ids=token_ids, logprobs=update.logprobs,
                        top_logprobs=update.top_logprobs, cached_tokens=update.cached_tokens)))
                continue
            if seq.detok_started:
                add(rid=rid, token_ids=token_ids, finished=finished)
            elif token_ids:
                add(rid=rid, token_ids=token_ids, finished=finished, stop=seq.stop,
                    traceparent=seq.traceparent, request_id=seq.request_id)
                seq.detok_started = True
            else:
                # Refused or ended before any token: nothing to detokenize.
                if finished and not (update.error.code == common_pb2.ERROR_CODE_UNAVAILABLE
                                     and self._hooks.retry(seq, update)):
                    seq.end(self._final_event(seq, update, ""))
                continue
            batch.append((seq, update))
        if batch:
            await self._send(request, batch)

    def flush(self, seqs: list[Sequence]) -> list[Sequence]:
        """Forget the detokenizer state of these (their engine is gone); the sequences whose
        flush was sent (its answer comes after every earlier answer for them)."""
        flush: Batch = [(s, None) for s in seqs if s.detok_started]
        if not flush or self._call is None or self.closing:
            return []
        request = detokenizer_pb2.DetokenizeRequest(updates=[
            detokenizer_pb2.DetokenizeUpdate(rid=s.rid, finished=True) for s, _ in flush])
        task = asyncio.create_task(self._send(request, flush))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)
        return [s for s, _ in flush]

    def _final_event(self, seq: Sequence, update: scheduler_pb2.TokenUpdate,
                     text: str) -> StepEvent:
        reason = finish_name(update.finish_reason)
        event = StepEvent(index=seq.index, text=text, finish_reason=reason,
                          cached_tokens=update.cached_tokens)
        if update.error.code or reason in ("error", "abort"):
            message = update.error.message or "the request was aborted upstream"
            error = (update.error if update.error.code
                     else proto_error(ErrorCode.UNAVAILABLE, message))
            event.error = from_upstream(error, self._retry_after)
            event.finish_reason = "error"
        return event

    # -- detokenizer stream ------------------------------------------------------------------

    async def _send(self, request: detokenizer_pb2.DetokenizeRequest, batch: Batch) -> None:
        call = self._call
        if call is None:
            self._fail_batch(batch, unavailable("the detokenizer is unavailable",
                                                self._retry_after))
            return
        async with self._lock:
            # Appended before the write: the answer may come right away.
            self._inflight.append(batch)
            try:
                await call.write(request)
            except Exception as exc:  # the reader fails the in-flight batches
                log.warning("detokenizer stream write failed: %r", exc)
                call.cancel()

    def _fail_batch(self, batch: Batch, error: ApiError) -> None:
        for seq, _ in batch:
            seq.detok_started = False
            if not seq.done:
                seq.end(StepEvent(index=seq.index, finish_reason="error", error=error))
                self._hooks.abort(seq, False)

    def _on_deltas(self, response: detokenizer_pb2.DetokenizeResponse) -> None:
        if not self._inflight:
            log.error("detokenizer answered a request that was not sent")
            return
        batch = self._inflight.popleft()
        deltas = response.deltas
        if len(deltas) != len(batch) or [d.rid for d in deltas] != [s.rid for s, _ in batch]:
            log.error("detokenizer answer does not match its request (%d vs %d updates)",
                      len(deltas), len(batch))
            self._fail_batch(batch, ApiError(502, "the detokenizer answered out of order",
                                             code="upstream_error"))
            return
        deliver = self._deliver
        for (seq, update), delta in zip(batch, deltas, strict=True):
            if update is None:
                seq.detok_started = False  # that update told the detokenizer to forget it
                if seq.lost is not None and not seq.done:
                    seq.end(StepEvent(index=seq.index, finish_reason="error", error=seq.lost))
                continue
            finish = update.finish_reason
            if finish:
                seq.detok_started = False
            if not seq.done:
                deliver(seq, update, delta, finish)

    def _deliver(self, seq: Sequence, update: scheduler_pb2.TokenUpdate,
                 delta: detokenizer_pb2.TextDelta, finish: int) -> None:
        # The event holds the update's repeated fields as they are (no copies): nothing
        # downstream changes them, and most streams never read logprobs at all.
        tokens: Seq[int] = update.token_ids
        logprobs: Seq[float] = update.logprobs
        tops: Seq[common_pb2.TopLogprobs] = update.top_logprobs
        if delta.stopped:
            keep = max(0, delta.num_tokens - seq.num_tokens)
            tokens, logprobs, tops = tokens[:keep], logprobs[:keep], tops[:keep]
            event = StepEvent(index=seq.index, text=delta.text, token_ids=tokens,
                              logprobs=logprobs, top_logprobs=tops, finish_reason="stop",
                              matched_stop=delta.matched_stop,
                              cached_tokens=update.cached_tokens)
            seq.num_tokens += len(tokens)
            if not finish:
                self._hooks.abort(seq, True)  # still generating upstream: stop it
            seq.end(event)
            return
        seq.num_tokens += len(tokens)
        if finish:
            event = self._final_event(seq, update, delta.text)
            event.token_ids, event.logprobs, event.top_logprobs = tokens, logprobs, tops
            seq.end(event)
            return
        # Positional: keyword arguments cost measurably at one event per token per stream.
        seq.sink.put(StepEvent(seq.index, delta.text, tokens, logprobs, tops, None, "", None,
                               update.cached_tokens))
