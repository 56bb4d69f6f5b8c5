"""The `minisgl.v1.Worker` gRPC service: a thin adapter over `Engine`.

A Step stream carries one StepRequest per scheduler step and gets one StepResponse per request,
in order. A reader thread launches each plan as soon as it arrives (at most two launched and not
yet answered), while the response generator collects them in order; so with overlap scheduling
the next plan is queued on the device while the previous one computes. A plan that fails (bad
plan, engine error) is answered with `StepResponse.error`; the stream and the process live on.
One stream drives the engine at a time; a second waits for the first to end.

Every reply carries the process's `epoch`, a random number chosen at start-up: a scheduler that
sees another epoch than before knows the worker restarted and its KV cache is empty. On SIGTERM
the steps already launched are computed and answered, plans that arrive after it are not run, and
the Step stream ends (the scheduler fails what it still had in flight with a clear error).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
from minisgl_core.codes import ErrorCode
from minisgl_core.convert import info_to_proto, output_to_proto, plan_from_proto
from minisgl_core.metrics import MODEL, STEP_BUCKETS, counter, histogram
from minisgl_core.proto.minisgl.v1 import worker_pb2, worker_pb2_grpc
from minisgl_core.sampling import InvalidParams
from minisgl_core.step import StepExecutor

from .convert import error_response
from .engine.batch import InvalidPlan
from .step_trace import step_ended, step_started

log = logging.getLogger(__name__)
_END = object()
MAX_UNANSWERED = 2
_METRICS: dict[str, Any] = {}
GRAPH_KINDS = ("cuda_graph", "piecewise", "eager")  # StepOutput.graph


def _metrics(model: str) -> dict[str, Any]:
    """The worker's series, labelled with its model (`model_name`, like the other tiers)."""
    if not _METRICS:  # prometheus metrics are process-wide; create them once
        _METRICS["steps"] = counter("worker_steps_total", "steps run by the worker", (MODEL,))
        _METRICS["errors"] = counter("worker_step_errors_total", "steps answered with an error",
                                     (MODEL,))
        _METRICS["tokens"] = counter("worker_sampled_tokens_total", "tokens sampled", (MODEL,))
        _METRICS["seconds"] = histogram("worker_step_seconds", "launch to result, per step",
                                        STEP_BUCKETS, (MODEL,))
        _METRICS["graph"] = counter(
            "worker_step_graph_total", "steps by how they ran: cuda_graph (a captured decode "
            "step), piecewise (graphs between eager attention calls) or eager", (MODEL, "graph"))
    out = {name: family.labels(model) for name, family in _METRICS.items() if name != "graph"}
    for graph in GRAPH_KINDS:  # children made up front: each series exists from the start
        out[f"graph:{graph}"] = _METRICS["graph"].labels(model, graph)
    return out


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: StepExecutor) -> None:
        self.engine = engine
        self._stream_lock = threading.Lock()
        self._active = 0
        self._idle = threading.Condition()
        self._orders: set[queue.Queue] = set()  # the answer queue of each open Step stream
        self._closing = False
        self.metrics = _metrics(engine.info().model_name)
        self.epoch = secrets.randbits(64) or 1  # 0 means "unknown" on the wire

    def GetWorkerInfo(self, request: worker_pb2.GetWorkerInfoRequest,
                      context: grpc.ServicerContext) -> worker_pb2.GetWorkerInfoResponse:
        reply = info_to_proto(self.engine.info())
        reply.epoch = self.epoch
        return reply

    def Step(self, request_iterator: Iterator[worker_pb2.StepRequest],
             context: grpc.ServicerContext) -> Iterator[worker_pb2.StepResponse]:
        with self._idle:
            self._active += 1
        try:
            with self._stream_lock:
                yield from self._serve(request_iterator)
        finally:
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    def _serve(self, requests: Iterator[worker_pb2.StepRequest]
               ) -> Iterator[worker_pb2.StepResponse]:
        order: queue.Queue = queue.Queue()  # ("step", id, t0) | ("error", id, code, msg) | _END
        room = threading.Semaphore(MAX_UNANSWERED)
        stop = threading.Event()
        reader = threading.Thread(target=self._launch_loop, args=(requests, order, room, stop),
                                  name="worker-launch", daemon=True)
        reader.start()
        with self._idle:
            self._orders.add(order)
            if self._closing:
                order.put(_END)
        try:
            while (item := order.get()) is not _END:
                try:
                    reply = self._answer(item)
                    reply.worker_epoch = self.epoch
                    yield reply
                finally:
                    room.release()
        finally:
            # The client went away mid-stream (or SIGTERM ended it): let the reader stop, then
            # collect whatever it launched so the engine's in-flight queue stays aligned for the
            # next stream. On SIGTERM the reader may sit waiting for a plan that never comes.
            with self._idle:
                self._orders.discard(order)
            stop.set()
            room.release()
            reader.join(timeout=1.0 if self._closing else None)
            while not order.empty():
                item = order.get()
                if item is not _END and item[0] == "step":
                    self._answer(item)

    def _launch_loop(self, requests: Iterator[worker_pb2.StepRequest], order: queue.Queue,
                     room: threading.Semaphore, stop: threading.Event) -> None:
        try:
            for req in requests:
                room.acquire()
                if stop.is_set() or self._closing:
                    break
                try:
                    plan = plan_from_proto(req)
                    span = step_started(req, plan)
                    t0 = time.perf_counter()
                    self.engine.launch(plan)
                    order.put(("step", req.step_id, t0, span))
                except (InvalidPlan, InvalidParams) as exc:
                    order.put(("error", req.step_id, ErrorCode.INVALID_ARGUMENT,
                               str(exc)))
                except Exception as exc:  # an engine failure: answer it, keep serving
                    log.exception("step %d failed at launch", req.step_id)
                    order.put(("error", req.step_id, ErrorCode.INTERNAL,
                               f"{type(exc).__name__}: {exc}"))
        except grpc.RpcError:
            pass  # the client cancelled the stream
        except Exception:
            log.exception("step stream reader failed")
        finally:
            order.put(_END)

    def _answer(self, item: tuple) -> worker_pb2.StepResponse:
        m = self.metrics
        if item[0] == "error":
            m["errors"].inc()
            return error_response(item[1], item[2], item[3])
        span = item[3]
        try:
            out = self.engine.collect()
        except Exception as exc:
            if span is not None:
                step_ended(span, None)
            log.exception("step %d failed", item[1])
            m["errors"].inc()
            return error_response(item[1], ErrorCode.INTERNAL,
                                  f"{type(exc).__name__}: {exc}")
        m["steps"].inc()
        if (graph := m.get(f"graph:{out.graph}")) is not None:  # "": unknown or nothing ran
            graph.inc()
        m["tokens"].inc(len(out.token_ids))
        m["seconds"].observe(time.perf_counter() - item[2])
        if span is not None:
            step_ended(span, out)
        return output_to_proto(out)

    def drain(self, timeout: float) -> None:
        """SIGTERM: answer the steps already launched, run no new plan, end every Step stream
        (waiting up to `timeout` for them to finish)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            self._closing = True
            for order in self._orders:
                order.put(_END)  # after the launched steps' entries: those are answered first
            while self._active and time.monotonic() < deadline:
                self._idle.wait(max(0.0, deadline - time.monotonic()))
