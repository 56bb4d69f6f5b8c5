"""The gateway's two long-lived upstream streams, shared by every request of the process.

    submits/aborts ──(coalesced)──▶ Scheduler.Connect ──ConnectResponse per step──▶ here
    here ──one DetokenizeRequest per ConnectResponse──▶ Detokenizer.Detokenize ──TextDeltas──▶ here
    here ──StepEvent──▶ the sink of the request the rid belongs to

A `Sequence` is one rid (one choice of one request). Requests put their sequences in, read
`StepEvent`s from their sink and `cancel` what they no longer want. When either stream breaks,
every affected sequence gets an error event at once (nothing waits forever) and the stream is
reopened in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from collections.abc import Sequence as Seq

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from minisgl_core.codes import ErrorCode, finish_name, proto_error
from minisgl_core.proto.minisgl.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from minisgl_core.reconnect import Backoff

from minisgl_gateway import metrics
from minisgl_gateway.errors import ApiError, from_upstream, unavailable
from minisgl_gateway.sequence import EventSink, Sequence, StepEvent

log = logging.getLogger(__name__)

# A sequence the gateway gave up on (stop string, client gone) waits for the scheduler's final
# update to flush its detokenizer state; past this it is forgotten anyway.
ORPHAN_TIMEOUT_S = 60.0


Batch = list[tuple[Sequence, scheduler_pb2.TokenUpdate | None]]


class Pipeline:
    def __init__(self, scheduler: grpc.aio.Channel, detokenizer: grpc.aio.Channel,
                 retry_after: int = 1) -> None:
        self._sched = scheduler_pb2_grpc.SchedulerStub(scheduler)
        self._detok = detokenizer_pb2_grpc.DetokenizerStub(detokenizer)
        self._health = {"scheduler": health_pb2_grpc.HealthStub(scheduler),
                        "detokenizer": health_pb2_grpc.HealthStub(detokenizer)}
        self._retry_after = retry_after
        self._live: dict[int, Sequence] = {}  # rid -> sequence, until the scheduler's last update
        self._submits: list[scheduler_pb2.SubmitItem] = []
        self._aborts: set[int] = set()
        self._stops: set[int] = set()  # ended by a stop string: finish upstream as STOP
        self._wake = asyncio.Event()
        self._sched_up = False
        self._detok_call: grpc.aio.StreamStreamCall | None = None
        self._detok_inflight: deque[Batch] = deque()
        self._detok_lock = asyncio.Lock()  # one write at a time, in the order of _detok_inflight
        self._tasks: list[asyncio.Task[None]] = []
        self._flushes: set[asyncio.Task[None]] = set()
        self._closing = False

    # -- public ------------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._connect_loop(), name="connect"),
                       asyncio.create_task(self._detok_loop(), name="detokenize"),
                       asyncio.create_task(self._sweep_loop(), name="sweep")]

    @property
    def ready(self) -> bool:
        return self._sched_up and self._detok_call is not None

    @property
    def live(self) -> int:
        return len(self._live)

    async def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.ready

    def submit(self, input_ids: list[int], sampling: common_pb2.SamplingParams,
               stop: common_pb2.StopConditions, index: int, sink: EventSink) -> Sequence:
        """Queue one sequence; it goes out with the next coalesced ConnectRequest."""
        if not self.ready:
            raise unavailable("the scheduler or detokenizer connection is down; retry shortly",
                              self._retry_after)
        rid = self._new_rid()
        seq = Sequence(rid=rid, index=index, sink=sink, stop=stop)
        self._live[rid] = seq
        self._submits.append(scheduler_pb2.SubmitItem(rid=rid, input_ids=input_ids,
                                                      sampling=sampling))
        self._wake.set()
        return seq

    def cancel(self, seqs: list[Sequence]) -> None:
        """The client no longer wants these: abort upstream with the next ConnectRequest."""
        running = {s.rid for s in seqs if not s.done}
        for seq in seqs:
            seq.end(None)
        # Not written yet: drop the submit instead of sending it together with its abort.
        unsent = {item.rid for item in self._submits} & running
        if unsent:
            self._submits = [item for item in self._submits if item.rid not in unsent]
            for rid in unsent:
                del self._live[rid]
        for rid in running - unsent:
            self._abort(rid)

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._fail_all(unavailable("the gateway is shutting down", self._retry_after))

    # -- scheduler stream --------------------------------------------------------------------

    def _new_rid(self) -> int:
        while True:
            rid = secrets.randbits(63)
            if rid and rid not in self._live:
                return rid

    def _abort(self, rid: int, stop: bool = False) -> None:
        if rid in self._live:
            (self._stops if stop else self._aborts).add(rid)
            self._wake.set()

    async def _keep_open(self, name: str, open_stream: Callable[[], grpc.aio.StreamStreamCall],
                         serve: Callable[[grpc.aio.StreamStreamCall], Awaitable[None]],
                         down: Callable[[grpc.aio.StreamStreamCall], bool],
                         lost: Callable[[str], None]) -> None:
        """Keep one stream to `name` open, for both upstream streams: `serve(call)` runs it once
        connected, `down(call)` marks it down when it ends (True if it had been up), `lost(reason)`
        fails what it carried. It is (re)opened only once the service's gRPC health says SERVING,
        polled with a jittered backoff of at most 1 s; the channel's own reconnect backoff is
        capped too (minisgl_core.reconnect), so a service that is back is found within a second.
        """
        backoff = Backoff()
        while not self._closing:
            if not await self._serving(name):
                await asyncio.sleep(backoff.next())
                continue
            call = open_stream()
            reason = f"the {name} closed the stream"
            try:
                await call.wait_for_connection()
                backoff.reset()
                log.info("%s stream open", name)
                await serve(call)
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug here must not leave requests hanging
                log.exception("%s stream handler failed", name)
                reason = repr(exc)
            finally:
                was_up = down(call)
                call.cancel()
            if was_up:
                log.warning("%s stream lost: %s", name, reason)
                metrics.UPSTREAM_STREAM_LOSSES.labels(name).inc()
            lost(reason)
            await asyncio.sleep(backoff.next())

    async def _serving(self, name: str) -> bool:
        """Whether `name` may take a stream now, by its gRPC health: one that listens but is not
        ready (a scheduler waiting for its worker, a service draining) would take the stream and
        end it at once, over and over. Waits up to a second for the channel to connect."""
        try:
            # The grpc_health stubs declare HealthStub without its methods.
            reply = await self._health[name].Check(health_pb2.HealthCheckRequest(),  # type: ignore[attr-defined]
                                                   wait_for_ready=True, timeout=1.0)
        except grpc.aio.AioRpcError as exc:
            # No health service there (UNIMPLEMENTED): the stream itself will tell.
            return exc.code() not in (grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.DEADLINE_EXCEEDED)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def _connect_loop(self) -> None:
        await self._keep_open("scheduler", self._sched.Connect, self._serve_connect,
                              self._connect_down, self._connect_lost)

    async def _serve_connect(self, call: grpc.aio.StreamStreamCall) -> None:
        writer = asyncio.create_task(self._write_connect(call))
        self._sched_up = True
        try:
            async for response in call:
                await self._on_step(response)
        finally:
            writer.cancel()

    def _connect_down(self, call: grpc.aio.StreamStreamCall) -> bool:
        was_up, self._sched_up = self._sched_up, False
        return was_up

    def _connect_lost(self, reason: str) -> None:
        self._submits.clear()
        self._aborts.clear()
        self._stops.clear()
        self._fail_all(unavailable(f"lost the connection to the scheduler ({reason})",
                                   self._retry_after))

    async def _write_connect(self, call: grpc.aio.StreamStreamCall) -> None:
        """Everything queued since the last send goes out as one ConnectRequest."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if not self._submits and not self._aborts and not self._stops:
                    continue
                aborts = [rid for rid in self._aborts if rid in self._live]
                stops = [rid for rid in self._stops if rid in self._live]
                request = scheduler_pb2.ConnectRequest(submits=self._submits, aborts=aborts,
                                                       stops=stops)
                self._submits, self._aborts, self._stops = [], set(), set()
                await call.write(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reader sees the broken stream and fails the requests
            log.warning("scheduler stream write failed: %r", exc)
            call.cancel()

    async def _on_step(self, response: scheduler_pb2.ConnectResponse) -> None:
        # Hot path: runs for every token of every stream. The DetokenizeUpdates are added in
        # place (constructing each and copying it into the request cost twice as much), and
        # each repeated field is read once.
        batch: Batch = []
        request = detokenizer_pb2.DetokenizeRequest()
        add = request.updates.add
        live = self._live
        for update in response.updates:
            rid = update.rid
            seq = live.get(rid)
            if seq is None:
                continue
            finished = update.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
            if finished:
                del live[rid]
            if seq.done:  # dropped by the gateway: only flush the detokenizer at the very end
                if finished and seq.detok_started:
                    add(rid=rid, finished=True)
                    batch.append((seq, None))
                continue
            token_ids = update.token_ids
            if seq.detok_started:
                add(rid=rid, token_ids=token_ids, finished=finished)
            elif token_ids:
                add(rid=rid, token_ids=token_ids, finished=finished, stop=seq.stop)
                seq.detok_started = True
            else:
                # Refused or ended before any token: nothing to detokenize.
                if finished:
                    seq.end(self._final_event(seq, update, ""))
                continue
            batch.append((seq, update))
        if batch:
            await self._send_detok(request, batch)

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

    def _fail_all(self, error: ApiError) -> None:
        """The scheduler stream is gone, and with it every request it carried."""
        flush: Batch = []
        for seq in self._live.values():
            seq.end(StepEvent(index=seq.index, finish_reason="error", error=error))
            if seq.detok_started:
                flush.append((seq, None))
        self._live.clear()
        if flush and self._detok_call is not None and not self._closing:
            request = detokenizer_pb2.DetokenizeRequest(updates=[
                detokenizer_pb2.DetokenizeUpdate(rid=s.rid, finished=True) for s, _ in flush])
            task = asyncio.create_task(self._send_detok(request, flush))
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)

    # -- detokenizer stream ------------------------------------------------------------------

    async def _detok_loop(self) -> None:
        await self._keep_open("detokenizer", self._detok.Detokenize, self._serve_detok,
                              self._detok_down, self._detok_lost)

    async def _serve_detok(self, call: grpc.aio.StreamStreamCall) -> None:
        self._detok_call = call
        async for response in call:
            self._on_deltas(response)

    def _detok_down(self, call: grpc.aio.StreamStreamCall) -> bool:
        was_up, self._detok_call = self._detok_call is call, None
        return was_up

    def _detok_lost(self, reason: str) -> None:
        self._on_detok_lost(unavailable(f"lost the connection to the detokenizer ({reason})",
                                        self._retry_after))

    async def _send_detok(self, request: detokenizer_pb2.DetokenizeRequest, batch: Batch) -> None:
        call = self._detok_call
        if call is None:
            self._fail_batch(batch, unavailable("the detokenizer is unavailable",
                                                self._retry_after))
            return
        async with self._detok_lock:
            # Appended before the write: the answer may come right away.
            self._detok_inflight.append(batch)
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
                self._abort(seq.rid)

    def _on_detok_lost(self, error: ApiError) -> None:
        while self._detok_inflight:
            self._fail_batch(self._detok_inflight.popleft(), error)
        # The new stream starts without their incremental state: they cannot continue.
        self._fail_batch([(s, None) for s in self._live.values() if s.detok_started], error)

    def _on_deltas(self, response: detokenizer_pb2.DetokenizeResponse) -> None:
        if not self._detok_inflight:
            log.error("detokenizer answered a request that was not sent")
            return
        batch = self._detok_inflight.popleft()
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
                self._abort(seq.rid, stop=True)  # still generating upstream: stop it
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

    # -- housekeeping ------------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(ORPHAN_TIMEOUT_S / 4)
            now = time.monotonic()
            stale = [r for r, s in self._live.items()
                     if s.done and now - s.done_at > ORPHAN_TIMEOUT_S]
            for rid in stale:
                log.warning("forgetting rid %d: no final update %.0fs after its abort",
                            rid, ORPHAN_TIMEOUT_S)
                del self._live[rid]
