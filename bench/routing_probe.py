"""Watches the engines while a routing benchmark runs: each engine's load polled every
`interval` seconds (GetLoad), to tell where a TTFT tail comes from: the requests each engine
received (its arrival counter), the longest waiting queue and the most running requests seen."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc
from minisgl_core.proto.minisgl.v1 import scheduler_pb2, scheduler_pb2_grpc


@dataclass
class EngineTrace:
    arrivals_start: int = -1
    arrivals_end: int = 0
    max_waiting: int = 0
    max_running: int = 0
    polls: int = 0

    @property
    def received(self) -> int:
        return max(0, self.arrivals_end - self.arrivals_start) if self.arrivals_start >= 0 else 0


class LoadProbe:
    """Polls every target's GetLoad on a thread between `start()` and `stop()`."""

    def __init__(self, targets: list[str], interval: float = 0.05) -> None:
        self.targets = targets
        self.interval = interval
        self.traces = [EngineTrace() for _ in targets]
        self._stop = threading.Event()
        self._channels = [grpc.insecure_channel(t) for t in targets]
        self._stubs = [scheduler_pb2_grpc.SchedulerStub(c) for c in self._channels]
        self._thread = threading.Thread(target=self._run, name="load-probe", daemon=True)

    def start(self) -> LoadProbe:
        self._poll()  # the arrival counters before the first request
        self._thread.start()
        return self

    def stop(self) -> list[EngineTrace]:
        self._stop.set()
        self._thread.join(10)
        self._poll()  # and after the last
        for c in self._channels:
            c.close()
        return self.traces

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._poll()

    def _poll(self) -> None:
        for stub, trace in zip(self._stubs, self.traces, strict=True):
            try:
                r = stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5)
            except grpc.RpcError:
                continue  # a missed sample; the next one comes in `interval`
            if trace.arrivals_start < 0:
                trace.arrivals_start = r.arrivals
            trace.arrivals_end = r.arrivals
            trace.max_waiting = max(trace.max_waiting, r.waiting_requests)
            trace.max_running = max(trace.max_running, r.running_requests)
            trace.polls += 1
