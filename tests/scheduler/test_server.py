"""The Scheduler gRPC service over loopback: a real server, the real WorkerClient, a Worker gRPC
server whose "GPU" is the fake executor. Connect submit/stream/abort/disconnect, unary RPCs,
refusals, a worker that dies, and the `python -m minisgl_scheduler` process itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
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

from .fake_executor import FakeExecutor, reference
from .fake_worker import start_fake_worker
from .helpers import Conn


class Stack:
    """fake worker (gRPC) <- WorkerClient <- Scheduler <- SchedulerService (gRPC) <- stub."""

    def __init__(self, step_delay: float = 0.0, step_timeout: float = 10.0,
                 **config: object) -> None:
        self.fake = FakeExecutor(num_pages=64, page_size=4, max_slots=8, max_model_len=256,
                                 eos_every=0)
        self.worker, self.worker_addr = start_fake_worker(self.fake, step_delay)
        self.client = WorkerClient(self.worker_addr, connect_timeout=10,
                                   step_timeout=step_timeout)
        self.sched = Scheduler(self.client, SchedulerConfig(**config))  # type: ignore[arg-type]
        self.service = SchedulerService(self.sched).start()
        self.host = ServiceHost("scheduler-test", "127.0.0.1", 0)
        self.host.add(scheduler_pb2_grpc.add_SchedulerServicer_to_server, self.service,
                      "minisgl.v1.Scheduler")
        self.addr = f"127.0.0.1:{self.host.start()}"
        self.channel = channel(self.addr)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.host.stop(drain_timeout=0)
        self.service.stop()
        self.worker.stop(drain_timeout=0)

    def load(self) -> scheduler_pb2.GetLoadResponse:
        return self.stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5)

    def wait_idle(self, timeout: float = 10.0) -> scheduler_pb2.GetLoadResponse:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            load = self.load()
            if load.running_requests == load.waiting_requests == load.used_pages == 0:
                return load
            time.sleep(0.02)
        raise AssertionError(f"scheduler not idle: {self.load()}")


@pytest.fixture
def stack() -> Iterator[Stack]:
    s = Stack()
    yield s
    s.close()


def test_connect_streams_batched_updates(stack: Stack) -> None:
    conn = Conn(stack.stub)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 14)]
    prompts = [[5, 6, 7], [5, 6, 7, 8], list(range(30))]
    conn.send([(100 + i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))])
    conn.read_until(lambda: len(conn.final) == 3)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        final = conn.final[100 + i]
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert final.prompt_tokens == len(p)
        assert conn.tokens[100 + i] == reference(p, sp, stack.fake)
    # Batched: far fewer responses than tokens (one response per step for the whole connection).
    assert conn.responses < sum(len(t) for t in conn.tokens.values())
    conn.requests.put(None)  # half-close: the stream ends once nothing is live
    assert list(conn.call) == []
    stack.wait_idle()
    info = stack.stub.GetInfo(scheduler_pb2.GetInfoRequest(), timeout=5)
    assert (info.model_name, info.page_size, info.num_pages, info.max_model_len) == (
        "fake", 4, 64, 256)
    assert info.max_running_requests == 8 and list(info.eos_token_ids) == [2]


def test_abort_through_the_stream_and_unary_abort() -> None:
    stack = Stack(step_delay=0.01)
    try:
        conn = Conn(stack.stub)
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        conn.send([(1, [1, 2, 3], long), (2, [4, 5, 6], long)])
        conn.read_until(lambda: len(conn.tokens.get(1, [])) >= 3)
        conn.send(aborts=[1])
        reply = stack.stub.Abort(scheduler_pb2.AbortRequest(rids=[2, 999]), timeout=5)
        assert reply.aborted == 1
        conn.read_until(lambda: len(conn.final) == 2)
        assert {conn.final[r].finish_reason for r in (1, 2)} == {common_pb2.FINISH_REASON_ABORT}
        assert len(conn.tokens[1]) < 200
        stack.wait_idle()
        conn.call.cancel()
    finally:
        stack.close()


def test_dropping_the_stream_aborts_its_requests() -> None:
    stack = Stack(step_delay=0.01)
    try:
        conn = Conn(stack.stub)
        long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        conn.send([(i, [i + 1] * 10, long) for i in range(4)])
        conn.read_until(lambda: len(conn.tokens) == 4)
        assert stack.load().running_requests == 4
        conn.call.cancel()  # the client goes away without a word
        load = stack.wait_idle()
        assert load.cached_pages > 0  # their KV stays reusable in the prefix cache
        assert stack.worker.servicer.steps < 200  # type: ignore[attr-defined]
    finally:
        stack.close()


def test_refusals_come_back_as_errors(stack: Stack) -> None:
    conn = Conn(stack.stub)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    conn.send([(1, [1] * 300, sp), (2, [], sp), (3, [1, 2], SamplingParams(top_p=0.0)),
               (4, [3, 4], sp)])
    conn.read_until(lambda: len(conn.final) == 4)
    codes = {r: conn.final[r].error.code for r in (1, 2, 3)}
    assert codes == {1: common_pb2.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED,
                     2: common_pb2.ERROR_CODE_INVALID_ARGUMENT,
                     3: common_pb2.ERROR_CODE_INVALID_ARGUMENT}
    assert "context window" in conn.final[1].error.message
    assert all(conn.final[r].finish_reason == common_pb2.FINISH_REASON_ERROR for r in codes)
    assert conn.final[4].finish_reason == common_pb2.FINISH_REASON_LENGTH
    conn.call.cancel()


def test_queue_overflow_is_overloaded() -> None:
    stack = Stack(step_delay=0.02, max_queued_requests=2, max_running_requests=1)
    try:
        conn = Conn(stack.stub)
        sp = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        conn.send([(i, [i + 1] * 4, sp) for i in range(6)])  # 1 runs, 2 wait, the rest refused
        conn.read_until(lambda: sum(
            u.error.code == common_pb2.ERROR_CODE_OVERLOADED for u in conn.final.values()) >= 1)
        refused = [r for r, u in conn.final.items()
                   if u.error.code == common_pb2.ERROR_CODE_OVERLOADED]
        assert refused and "queue is full" in conn.final[refused[0]].error.message
        conn.call.cancel()
        stack.wait_idle()
    finally:
        stack.close()


def test_worker_death_fails_requests_instead_of_hanging() -> None:
    stack = Stack(step_delay=0.01)
    try:
        conn = Conn(stack.stub)
        long = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        conn.send([(1, [1, 2, 3], long), (2, [3, 4], long)])
        conn.read_until(lambda: len(conn.tokens.get(1, [])) >= 2)
        stack.worker.stop(drain_timeout=0)
        conn.read_until(lambda: len(conn.final) == 2, timeout=20)
        for r in (1, 2):
            assert conn.final[r].finish_reason == common_pb2.FINISH_REASON_ERROR
            assert conn.final[r].error.code == common_pb2.ERROR_CODE_UNAVAILABLE
        stack.wait_idle()
        conn.call.cancel()
    finally:
        stack.close()


def test_a_hung_worker_times_out_into_errors() -> None:
    stack = Stack(step_delay=0.5, step_timeout=0.2)
    try:
        conn = Conn(stack.stub)
        conn.send([(1, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5))])
        conn.read_until(lambda: 1 in conn.final)
        assert conn.final[1].error.code == common_pb2.ERROR_CODE_UNAVAILABLE
        assert "did not answer" in conn.final[1].error.message
        stack.wait_idle()
        conn.call.cancel()
    finally:
        stack.close()


def test_service_process_help_metrics_and_sigterm(tmp_path: Path) -> None:
    """`python -m minisgl_scheduler` against the gRPC fake worker, drained by SIGTERM -> exit 0."""
    fake = FakeExecutor(num_pages=32, page_size=4, max_slots=4, max_model_len=128)
    worker, worker_addr = start_fake_worker(fake, step_delay=0.02)
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "MINISGL_SCHEDULER_MAX_RUNNING_REQUESTS": "3"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "minisgl_scheduler", "--worker", worker_addr, "--port", str(port),
         "--metrics-port", str(metrics_port), "--cache", "radix", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_health(f"127.0.0.1:{port}", timeout=30)
        with channel(f"127.0.0.1:{port}") as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            info = stub.GetInfo(scheduler_pb2.GetInfoRequest(), timeout=5)
            assert info.max_running_requests == 3  # from the environment
            conn = Conn(stub)
            sp = SamplingParams(temperature=0.0, max_tokens=5)
            conn.send([(7, [9, 8, 7], sp)])
            conn.read_until(lambda: 7 in conn.final)
            assert conn.tokens[7] == reference([9, 8, 7], sp, fake)
            load = stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5)
            assert load.total_pages == 32 and load.running_requests == 0
            body = urllib.request.urlopen(
                f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
            # SIGTERM while a request runs: it completes, then the process exits 0.
            long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            conn.send([(8, [1, 2], long)])
            conn.read_until(lambda: 8 in conn.tokens)
            proc.send_signal(signal.SIGTERM)
            conn.read_until(lambda: 8 in conn.final)
            assert conn.final[8].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert conn.tokens[8] == reference([1, 2], long, fake)
            assert list(conn.call) == []  # the server ends the stream when it stops
        for name in ("minisgl_num_requests_running", "minisgl_num_requests_waiting",
                     "minisgl_kv_cache_usage_perc", "minisgl_num_preemptions_total",
                     "minisgl_prefix_cache_hits_total", "minisgl_scheduler_time_to_first_token_seconds",
                     "minisgl_scheduler_inter_token_latency_seconds"):
            assert name in body, name
        model = '{model_name="fake"}'
        assert ('minisgl_request_success_total{finished_reason="length",model_name='
                '"fake"} 1.0') in body
        assert f"minisgl_scheduler_time_to_first_token_seconds_count{model} 1.0" in body
        assert f"minisgl_scheduler_prompt_tokens_total{model} 3.0" in body
        assert f"minisgl_scheduler_generation_tokens_total{model} 5.0" in body
        # The request phases and lengths of the one finished request (vLLM's histograms).
        for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                     "request_decode_time_seconds", "request_inference_time_seconds",
                     "request_prompt_tokens", "request_generation_tokens"):
            assert f"minisgl_{name}_count{model} 1.0" in body, name
        assert f"minisgl_request_generation_tokens_sum{model} 5.0" in body
        assert "minisgl_cache_config_info{block_size=" in body
        assert "minisgl_prefix_cache_hit_rate" in body and "minisgl_scheduler_e2e_request_latency" in body
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        worker.stop(drain_timeout=0)
