"""`StepExecutor` over the worker's gRPC `Step` stream: one StepRequest per step, answers in order.

`launch` only queues the plan (the stream sends it in the background), so with overlap the next
plan is on the wire while the worker still computes the previous one. A broken stream, a worker
error or a step that takes longer than `step_timeout` make `collect` raise `WorkerFailed` for every
step sent on that stream; the scheduler then fails the affected requests, and the next `launch`
opens a fresh stream (the worker may have been restarted).

A worker process has an identity, its `epoch`. Between steps `check_worker` asks the worker for its
info whenever no healthy stream is open; another epoch than before means a new process with an
empty KV cache, which the scheduler must learn before it plans on cached pages. Every step reply
carries the epoch too, so a restart that slips in between the check and the new stream still fails
that step instead of returning tokens computed over missing KV.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from minisgl_core.convert import info_from_proto, plan_to_proto
from minisgl_core.proto.minisgl.v1 import worker_pb2, worker_pb2_grpc
from minisgl_core.serving import channel
from minisgl_core.step import StepExecutor, StepOutput, StepPlan, WorkerInfo

from minisgl_scheduler.convert import output_from_proto
from minisgl_scheduler.errors import SchedulerError, WorkerFailed

log = logging.getLogger(__name__)
_END = object()


@dataclass
class _Stream:
    call: grpc.Future[Any] | None = None
    outbox: queue.Queue[Any] = field(default_factory=queue.Queue)  # StepRequest | _END
    inbox: queue.Queue[Any] = field(default_factory=queue.Queue)  # StepResponse | Exception
    failure: Exception | None = None

    def requests(self) -> Iterator[worker_pb2.StepRequest]:
        while (item := self.outbox.get()) is not _END:
            yield item


class WorkerClient(StepExecutor):
    """`connect_timeout` bounds the wait for the worker at start-up; 0 waits until it answers
    (or `stop` is set: WorkerFailed)."""

    # A worker that does not answer GetWorkerInfo within this (between steps, after its stream
    # broke) counts as down: the scheduler fails what waits for it rather than stall its loop.
    CHECK_TIMEOUT_S = 1.0

    def __init__(self, target: str, connect_timeout: float = 120.0,
                 step_timeout: float = 600.0, stop: threading.Event | None = None) -> None:
        self.target = target
        self.step_timeout = step_timeout
        self._channel = channel(target)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        try:
            self._info = self._wait_for_worker(connect_timeout, stop)
        except BaseException:
            self._channel.close()
            raise
        self._stream: _Stream | None = None
        self._sent: deque[_Stream] = deque()  # the stream each launched step went out on
        self._closed = False

    def _wait_for_worker(self, timeout: float, stop: threading.Event | None) -> WorkerInfo:
        start = time.monotonic()
        deadline = start + timeout if timeout > 0 else math.inf
        next_note = start + 10.0
        while True:
            if stop is not None and stop.is_set():
                raise WorkerFailed(f"stopped while waiting for the worker at {self.target}")
            began = time.monotonic()
            try:
                reply = self._stub.GetWorkerInfo(
                    worker_pb2.GetWorkerInfoRequest(), wait_for_ready=True,
                    timeout=max(0.05, min(2.0, deadline - began)))
                return info_from_proto(reply)
            except grpc.RpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
            now = time.monotonic()
            if now >= deadline:
                raise WorkerFailed(f"cannot reach the worker at {self.target} within "
                                   f"{timeout:.0f}s: {error}")
            if now >= next_note:
                log.info("still waiting for the worker at %s after %.0fs (%s)", self.target,
                         now - start, error)
                next_note = now + 30.0
            if now - began < 0.2:  # refused at once (not a wait for the connection): pace it
                time.sleep(0.2)

    def info(self) -> WorkerInfo:
        return self._info

    def check_worker(self) -> WorkerInfo | None:
        """Between steps: None while the worker is the process we know, its info when another
        process (a restarted worker) answers. Raises WorkerFailed when it cannot be reached."""
        stream = self._stream
        if stream is not None and stream.failure is None:
            return None  # an open stream is bound to the process it was opened to
        try:
            reply = self._stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(),
                                             wait_for_ready=True, timeout=self.CHECK_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise WorkerFailed(f"the worker at {self.target} is unreachable: "
                               f"{exc.code().name}: {exc.details()}") from None
        info = info_from_proto(reply)
        if info.epoch == self._info.epoch:
            return None
        self._info = info
        return info

    def launch(self, plan: StepPlan) -> None:
        if self._closed:
            raise WorkerFailed("the worker client is closed")
        stream = self._stream
        if stream is None or stream.failure is not None:
            stream = self._stream = self._open()
        stream.outbox.put(plan_to_proto(plan))
        self._sent.append(stream)

    def collect(self) -> StepOutput:
        if not self._sent:
            raise SchedulerError("collect() without a launched step")
        stream = self._sent.popleft()
        try:  # answers that arrived before a failure still count
            item = stream.inbox.get_nowait()
        except queue.Empty:
            if stream.failure is not None:
                raise stream.failure from None
            try:
                item = stream.inbox.get(timeout=self.step_timeout)
            except queue.Empty:
                self._fail(stream, WorkerFailed(
                    f"the worker did not answer within {self.step_timeout:.0f}s"))
                raise stream.failure from None  # type: ignore[misc]  # _fail set it
        if isinstance(item, Exception):
            raise item
        if item.worker_epoch and item.worker_epoch != self._info.epoch:
            self._fail(stream, WorkerFailed("the worker restarted: a new process answered the step"))
            raise stream.failure from None  # type: ignore[misc]  # _fail set it
        return output_from_proto(item)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._stream is not None:
            self._fail(self._stream, WorkerFailed("the worker client is closed"))
        self._channel.close()

    # -- stream handling ---------------------------------------------------------------------------

    def _open(self) -> _Stream:
        stream = _Stream()
        stream.call = self._stub.Step(stream.requests())
        threading.Thread(target=self._read, args=(stream,), name="worker-stream",
                         daemon=True).start()
        return stream

    def _read(self, stream: _Stream) -> None:
        call = stream.call
        assert call is not None
        try:
            # A stream-stream call is also the response iterator; the stubs type it as a Future.
            for reply in call:  # type: ignore[attr-defined]
                stream.inbox.put(reply)
            self._fail(stream, WorkerFailed("the worker closed the step stream"))
        except grpc.RpcError as exc:
            self._fail(stream, WorkerFailed(
                f"the worker stream broke: {exc.code().name}: {exc.details()}"))

    def _fail(self, stream: _Stream, exc: Exception) -> None:
        """Every step still waiting on `stream` fails with `exc`; the stream is torn down."""
        if stream.failure is None:
            stream.failure = exc
            log.error("worker %s: %s", self.target, exc)
        # Wake a collect() that is blocked on this stream; later ones see `failure` first.
        stream.inbox.put(stream.failure)
        stream.outbox.put(_END)
        if stream.call is not None:
            stream.call.cancel()
