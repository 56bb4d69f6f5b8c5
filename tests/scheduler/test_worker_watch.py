"""What a gateway's Watch stream learns of the worker behind the scheduler: that it is down (the
gateway then routes around the engine) and back, even while the engine is idle; and that the
prefix cache of a restarted worker reports its pages like the first one did (the old pages are
reported gone). A real gRPC scheduler over the in-process restartable fake worker."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import grpc
import pytest
from minisgl_core.prefix_hash import page_hashes
from minisgl_core.proto.minisgl.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from minisgl_core.sampling import SamplingParams
from minisgl_core.serving import ServiceHost, channel
from minisgl_scheduler import Scheduler, SchedulerConfig
from minisgl_scheduler.server import SchedulerService

from .helpers import Conn
from .test_worker_restart import PROMPT, RestartingWorker

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class Watched:
    """A scheduler service on a restartable fake worker, one Watch stream read into an index."""

    def __init__(self) -> None:
        self.worker = RestartingWorker(num_pages=32, page_size=4, max_slots=4)
        self.sched = Scheduler(self.worker, SchedulerConfig(cache="radix"))
        self.service = SchedulerService(self.sched).start()
        self.host = ServiceHost("scheduler-test", "127.0.0.1", 0)
        self.host.add(scheduler_pb2_grpc.add_SchedulerServicer_to_server, self.service,
                      "minisgl.v1.Scheduler")
        self.channel = channel(f"127.0.0.1:{self.host.start()}")
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.call = self.stub.Watch(scheduler_pb2.WatchRequest(load_interval_s=0.05), timeout=60)
        self.msgs: queue.Queue[scheduler_pb2.WatchResponse] = queue.Queue()
        self.index: set[int] = set()
        self.load = scheduler_pb2.EngineLoad()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                self.msgs.put(msg)
        except grpc.RpcError:
            pass  # cancelled at the end

    def until(self, done: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
        """Apply Watch messages (as the gateway's EngineView does) until `done()`."""
        while not done():
            try:
                msg = self.msgs.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"timed out waiting for {what}") from None
            if msg.snapshot:
                self.index = set(msg.stored)
            self.index |= set(msg.stored)
            self.index -= set(msg.removed)
            if msg.HasField("load"):
                self.load = msg.load

    def serve(self, rid: int) -> scheduler_pb2.TokenUpdate:
        conn = Conn(self.stub)
        conn.send([(rid, PROMPT, GREEDY)])
        conn.read_until(lambda: rid in conn.final)
        conn.call.cancel()
        return conn.final[rid]

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()
        self.host.stop(drain_timeout=0)
        self.service.stop()


@pytest.fixture
def watched() -> Iterator[Watched]:
    w = Watched()
    yield w
    w.close()


def test_an_idle_engine_reports_its_worker_down_and_back(watched: Watched) -> None:
    watched.until(lambda: watched.load.max_running_requests > 0, "the first load report")
    assert not watched.load.worker_down
    watched.worker.down = True  # no request runs: only the loop's idle probe can notice
    watched.until(lambda: watched.load.worker_down, "a report of the worker down")
    conn = Conn(watched.stub)  # a request sent meanwhile fails at once, clearly
    conn.send([(1, PROMPT, GREEDY)])
    conn.read_until(lambda: 1 in conn.final)
    assert conn.final[1].error.code == common_pb2.ERROR_CODE_UNAVAILABLE
    conn.call.cancel()
    watched.worker.down = False
    watched.until(lambda: not watched.load.worker_down, "a report of the worker back")
    assert watched.serve(2).finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_a_restarted_worker_cache_reports_its_prefixes(watched: Watched) -> None:
    prompt_pages = set(page_hashes(PROMPT, 4))
    assert watched.serve(1).finish_reason == common_pb2.FINISH_REASON_LENGTH
    watched.until(lambda: prompt_pages <= watched.index, "the prompt's pages cached")

    watched.worker.down = True
    watched.until(lambda: watched.load.worker_down, "a report of the worker down")
    watched.worker.restart()  # a new process: empty KV
    watched.worker.down = False
    watched.until(lambda: not watched.load.worker_down, "a report of the worker back")
    # The old cache went with the old process: its pages are reported gone.
    watched.until(lambda: not watched.index, "the old pages removed")

    update = watched.serve(2)
    assert update.finish_reason == common_pb2.FINISH_REASON_LENGTH and update.cached_tokens == 0
    watched.until(lambda: prompt_pages <= watched.index, "the new cache's pages reported")
    assert watched.serve(3).cached_tokens == 16  # and the cache is really there
