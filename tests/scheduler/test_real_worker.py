"""The scheduler service over the real worker process (tiny model on CPU), no fakes at all.

The worker runs as a subprocess, so this test process stays torch-free. Greedy outputs must not
depend on batching, prefix-cache hits or preemption: every request gives the same tokens alone on
an idle worker as in a crowded batch on a pool too small for all of them.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from minisgl_core.ports import free_port
from minisgl_core.proto.minisgl.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from minisgl_core.sampling import SamplingParams
from minisgl_core.serving import ServiceHost, channel, wait_for_health
from minisgl_scheduler import Scheduler, SchedulerConfig
from minisgl_scheduler.server import SchedulerService
from minisgl_scheduler.worker_client import WorkerClient

from .helpers import Conn

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not (TINY / "config.json").exists():
        pytest.fail(f"the embedded model is missing at {TINY}")
    port = free_port()
    log = open(tmp_path_factory.mktemp("worker") / "worker.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "minisgl_worker", "--model", str(TINY), "--port", str(port),
         "--metrics-port", "0", "--page-size", "4", "--num-pages", "24", "--max-slots", "8",
         "--dtype", "float32", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_health(f"127.0.0.1:{port}", timeout=120)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


class Service:
    def __init__(self, worker: str, **config: object) -> None:
        self.sched = Scheduler(WorkerClient(worker, connect_timeout=30, step_timeout=60),
                               SchedulerConfig(**config))  # type: ignore[arg-type]
        self.service = SchedulerService(self.sched).start()
        self.host = ServiceHost("scheduler-real", "127.0.0.1", 0)
        self.host.add(scheduler_pb2_grpc.add_SchedulerServicer_to_server, self.service,
                      "minisgl.v1.Scheduler")
        self.channel = channel(f"127.0.0.1:{self.host.start()}")
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)

    def run(self, batch: list[tuple[int, list[int], SamplingParams]]) -> Conn:
        conn = Conn(self.stub)
        conn.send(batch)
        conn.read_until(lambda: len(conn.final) == len(batch), timeout=120)
        conn.requests.put(None)
        return conn

    def close(self) -> None:
        self.channel.close()
        self.host.stop(drain_timeout=0)
        self.service.stop()


PROMPTS = [[(7 * i + 3 * k) % 4000 + 3 for k in range(12 + 3 * i)] for i in range(6)]
SHARED = [100 + k for k in range(16)]  # a prefix several prompts share
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# Penalties see prompt and outputs: after a preemption or a cache hit the worker must rebuild
# them from history_ids / recomputed inputs (num_prompt_tokens splits prompt from outputs).
PENALISED = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                           presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)


@pytest.mark.parametrize(("overlap", "params"),
                         [(True, GREEDY), (False, GREEDY), (True, PENALISED)])
def test_outputs_do_not_depend_on_batching_cache_or_preemption(worker: str, overlap: bool,
                                                                params: SamplingParams) -> None:
    prompts = PROMPTS + [SHARED + p[:4] for p in PROMPTS[:3]]
    svc = Service(worker, disable_overlap=not overlap, decode_reserve_ratio=0.0,
                  max_prefill_tokens=32)
    try:
        alone = []
        for i, p in enumerate(prompts):  # one at a time on an idle worker
            conn = svc.run([(i, p, params)])
            alone.append(conn.tokens[i])
            assert conn.final[i].finish_reason == common_pb2.FINISH_REASON_LENGTH
        crowded = svc.run([(100 + i, p, params) for i, p in enumerate(prompts)])
        for i in range(len(prompts)):
            assert crowded.tokens[100 + i] == alone[i], i
        assert sum(crowded.final[100 + i].cached_tokens for i in range(len(prompts))) > 0
        load = svc.stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5)
        assert load.used_pages == 0 and load.total_pages == 24
        stats = svc.sched.stats()
        assert stats.preemptions > 0  # 9 requests x ~30 tokens in a 96-token pool
    finally:
        svc.close()


def test_abort_and_disconnect_on_the_real_worker(worker: str) -> None:
    svc = Service(worker)
    try:
        conn = Conn(svc.stub)
        long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        conn.send([(1, PROMPTS[0], long), (2, PROMPTS[1], long)])
        conn.read_until(lambda: len(conn.tokens.get(1, [])) >= 2, timeout=60)
        conn.send(aborts=[1])
        conn.read_until(lambda: 1 in conn.final, timeout=60)
        assert conn.final[1].finish_reason == common_pb2.FINISH_REASON_ABORT
        conn.call.cancel()  # drops request 2 with it
        for _ in range(600):
            load = svc.stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5)
            if load.running_requests == 0 and load.used_pages == 0:
                break
            time.sleep(0.05)
        assert load.running_requests == 0 and load.used_pages == 0
    finally:
        svc.close()
