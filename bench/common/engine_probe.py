"""What each engine did during a routing benchmark, to tell where a TTFT tail comes from:
from its /metrics before and after (prefix-cache hit and query tokens, requests finished, its
queue-time histogram: arrival to first scheduled), and from its load polled over gRPC while the
load runs (the longest waiting queue and the most running requests seen)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import grpc
from minisgl_core.proto.minisgl.v1 import scheduler_pb2, scheduler_pb2_grpc

from bench.common import prefix_cache

QUEUE_HISTOGRAM = "minisgl_request_queue_time_seconds"


@dataclass
class EngineCounters:
    hits: float = 0.0  # prefix-cache hit tokens
    queries: float = 0.0  # prefix-cache query tokens
    finished: float = 0.0  # requests ended (any finish reason)
    preemptions: float = 0.0  # running requests sent back to the queue for lack of KV pages
    queue_buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count

    def minus(self, before: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.hits - before.hits, self.queries - before.queries,
            self.finished - before.finished, self.preemptions - before.preemptions,
            {le: n - before.queue_buckets.get(le, 0.0) for le, n in self.queue_buckets.items()})

    def queue_quantile(self, q: float) -> float | str | None:
        """The upper bound of the histogram bucket holding the q-quantile of queue times: None
        without samples, "+Inf" (as Prometheus writes it; JSON has no infinity) past the last
        finite bucket."""
        total = self.queue_buckets.get(float("inf"), 0.0)
        if total <= 0:
            return None
        for le in sorted(self.queue_buckets):
            if self.queue_buckets[le] >= q * total:
                return le if le != float("inf") else "+Inf"
        return "+Inf"


def scrape(port: int) -> EngineCounters:
    from prometheus_client.parser import text_string_to_metric_families

    text = prefix_cache.read(f"http://127.0.0.1:{port}/metrics")
    out = EngineCounters()
    out.hits, out.queries = prefix_cache.counters_in(text, "minisgl")
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "minisgl_request_success_total":
                out.finished += s.value
            elif s.name == "minisgl_num_preemptions_total":
                out.preemptions += s.value
            elif s.name == QUEUE_HISTOGRAM + "_bucket":
                le = float(s.labels["le"])
                out.queue_buckets[le] = out.queue_buckets.get(le, 0.0) + s.value
    return out


@dataclass
class LoadTrace:
    max_waiting: int = 0
    max_running: int = 0
    polls: int = 0


class LoadProbe:
    """Polls every scheduler's GetLoad on a thread between `start()` and `stop()`. Start it after
    any process pool has forked: a fork beside live gRPC threads can hang the child."""

    def __init__(self, targets: list[str], interval: float = 0.05) -> None:
        self.interval = interval
        self.traces = [LoadTrace() for _ in targets]
        self._stop = threading.Event()
        self._channels = [grpc.insecure_channel(t) for t in targets]
        self._stubs = [scheduler_pb2_grpc.SchedulerStub(c) for c in self._channels]
        self._thread = threading.Thread(target=self._run, name="load-probe", daemon=True)

    def start(self) -> LoadProbe:
        self._thread.start()
        return self

    def stop(self) -> list[LoadTrace]:
        self._stop.set()
        self._thread.join(10)
        for c in self._channels:
            c.close()
        return self.traces

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for stub, trace in zip(self._stubs, self.traces, strict=True):
                try:
                    r = stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5)
                except grpc.RpcError:
                    continue  # a missed sample; the next comes in `interval`
                trace.max_waiting = max(trace.max_waiting, r.waiting_requests)
                trace.max_running = max(trace.max_running, r.running_requests)
                trace.polls += 1
