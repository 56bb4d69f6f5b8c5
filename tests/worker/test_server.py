"""The worker's gRPC adapter over loopback: the Step stream (with the scheduler's real client and
with raw messages), errors answered in-stream, and the `python -m minisgl_worker` process."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from minisgl_core.serving import ServiceHost, channel, wait_for_health
from minisgl_worker.engine import Engine, EngineConfig
from minisgl_worker.server import WorkerService

from .driver import run_requests
from .test_engine import PROMPTS

PAGE = 4


@pytest.fixture(scope="module")
def served(tiny_model) -> Iterator[tuple[Engine, str]]:  # noqa: ANN001
    engine = Engine(EngineConfig(model_path=str(tiny_model("qwen3")), page_size=PAGE,
                                 num_pages=128, max_slots=4))
    host = ServiceHost("worker-test", "127.0.0.1", 0, max_workers=8)
    host.add(worker_pb2_grpc.add_WorkerServicer_to_server, WorkerService(engine),
             "minisgl.v1.Worker")
    port = host.start()
    yield engine, f"127.0.0.1:{port}"
    host.stop(drain_timeout=1.0)
    engine.close()


def test_scheduler_client_over_grpc_matches_engine(served: tuple[Engine, str]) -> None:
    from minisgl_scheduler.worker_client import WorkerClient

    engine, target = served
    expected = run_requests(engine, PROMPTS, 6, PAGE, chunk=5, starts=[0, 1, 3])
    client = WorkerClient(target, connect_timeout=10)
    try:
        info = client.info()
        assert (info.vocab_size, info.num_pages, info.page_size) == (512, 128, PAGE)
        got = run_requests(client, PROMPTS, 6, PAGE, chunk=5, starts=[0, 1, 3])
    finally:
        client.close()
    assert got == expected


def test_steps_are_counted_by_how_they_ran(served: tuple[Engine, str]) -> None:
    """`minisgl_worker_step_graph_total{graph}`: on the CPU every step runs eagerly, and the
    CUDA-graph series exist (at zero) before any step."""
    from minisgl_scheduler.worker_client import WorkerClient
    from prometheus_client import REGISTRY

    engine, target = served
    model = engine.info().model_name

    def count(graph: str) -> float | None:
        return REGISTRY.get_sample_value("minisgl_worker_step_graph_total",
                                         {"model_name": model, "graph": graph})

    before = count("eager") or 0.0
    client = WorkerClient(target, connect_timeout=10)
    try:
        run_requests(client, PROMPTS[:2], 3, PAGE)
    finally:
        client.close()
    assert count("eager") == before + 3  # one prefill step, two decode steps
    assert count("cuda_graph") == 0 and count("piecewise") == 0


def _stream(stub: worker_pb2_grpc.WorkerStub) -> tuple[queue.Queue, Iterator]:
    outbox: queue.Queue = queue.Queue()
    responses = stub.Step(iter(outbox.get, None))
    return outbox, responses


def test_bad_step_answered_with_error_and_stream_lives(served: tuple[Engine, str]) -> None:
    _, target = served
    greedy = common_pb2.SamplingParams(temperature=0.0)
    with channel(target) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        outbox, responses = _stream(stub)
        ok = worker_pb2.StepRequest(step_id=1, requests=[worker_pb2.RequestPlan(
            rid=7, slot=0, input_ids=[1, 2, 3], new_pages=[0], sample=True, sampling=greedy)])
        bad_slot = worker_pb2.StepRequest(step_id=2, requests=[worker_pb2.RequestPlan(
            rid=8, slot=1000, input_ids=[1], new_pages=[1], sample=True)])
        bad_params = worker_pb2.StepRequest(step_id=3, requests=[worker_pb2.RequestPlan(
            rid=9, slot=1, input_ids=[1], new_pages=[1], sample=True,
            sampling=common_pb2.SamplingParams(top_p=0.0))])
        decode = worker_pb2.StepRequest(step_id=4, decodes=worker_pb2.DecodeEntries(
            rids=[7], slots=[0], cache_lens=[3], page_offsets=[1], new_page_counts=[0]))
        for req in (ok, bad_slot, bad_params, decode):
            outbox.put(req)
        answers = [next(responses) for _ in range(4)]
        outbox.put(None)
        assert [a.step_id for a in answers] == [1, 2, 3, 4]
        assert list(answers[0].rids) == [7] and not answers[0].HasField("error")
        assert answers[1].error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT
        assert "slot 1000" in answers[1].error.message
        assert answers[2].error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT
        assert "top_p" in answers[2].error.message
        assert list(answers[3].rids) == [7] and len(answers[3].token_ids) == 1
        assert list(responses) == []  # the server ends the stream after the client does
        info = stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest())
        assert info.attention_backend == "torch" and info.max_slots == 4
        assert info.kv_cache_dtype == "float32"  # CPU default: the activation dtype


def test_malformed_decode_columns_answered_with_error(served: tuple[Engine, str]) -> None:
    _, target = served
    with channel(target) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        outbox, responses = _stream(stub)
        outbox.put(worker_pb2.StepRequest(step_id=1, decodes=worker_pb2.DecodeEntries(
            rids=[1, 2], slots=[0], cache_lens=[3, 3], page_offsets=[0, 0],
            new_page_counts=[0, 0])))
        outbox.put(worker_pb2.StepRequest(step_id=2, decodes=worker_pb2.DecodeEntries(
            rids=[1], slots=[0], cache_lens=[3], page_offsets=[0], new_page_counts=[2],
            new_pages=[1])))
        answers = [next(responses) for _ in range(2)]
        outbox.put(None)
        for a in answers:
            assert a.error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT
            assert "decodes" in a.error.message
        assert list(responses) == []


def test_a_decode_sent_as_a_request_plan_is_refused(served: tuple[Engine, str]) -> None:
    """Decodes travel only as columns: a RequestPlan without input_ids breaks the contract."""
    _, target = served
    with channel(target) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        outbox, responses = _stream(stub)
        outbox.put(worker_pb2.StepRequest(step_id=1, requests=[
            worker_pb2.RequestPlan(rid=1, slot=0, cache_len=0, new_pages=[0], sample=True)]))
        answer = next(responses)
        outbox.put(None)
        assert answer.error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT
        assert "without input_ids" in answer.error.message
        assert list(responses) == []


def test_client_plans_cross_the_wire_as_columns(served: tuple[Engine, str],
                                                monkeypatch) -> None:  # noqa: ANN001
    """Through the scheduler's client every decode goes as a column of StepRequest.decodes, and
    the tokens are the in-process engine's."""
    from minisgl_core import convert
    from minisgl_scheduler import worker_client
    from minisgl_scheduler.worker_client import WorkerClient

    engine, target = served
    expected = run_requests(engine, PROMPTS, 4, PAGE, chunk=5, starts=[0, 1, 3])
    sent: list[tuple[int, int]] = []  # per step: (decode columns, request plans without inputs)
    original = convert.plan_to_proto

    def spy(plan):  # noqa: ANN001, ANN202
        msg = original(plan)
        sent.append((len(msg.decodes.rids), sum(not m.input_ids for m in msg.requests)))
        return msg

    monkeypatch.setattr(worker_client, "plan_to_proto", spy)
    client = WorkerClient(target, connect_timeout=10)
    try:
        got = run_requests(client, PROMPTS, 4, PAGE, chunk=5, starts=[0, 1, 3])
    finally:
        client.close()
    assert got == expected
    assert sum(n for n, _ in sent) > 0 and not any(rows for _, rows in sent)


def test_worker_process(tiny_model, tmp_path) -> None:  # noqa: ANN001
    from minisgl_core.ports import free_port

    port = free_port()
    env = dict(os.environ, MINISGL_WORKER_PORT=str(port), MINISGL_WORKER_MAX_SLOTS="3")
    proc = subprocess.Popen(
        [sys.executable, "-m", "minisgl_worker", "--model", str(tiny_model("qwen3")),
         "--metrics-port", "0", "--num-pages", "32", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_health(f"127.0.0.1:{port}", timeout=60)
        with channel(f"127.0.0.1:{port}") as ch:
            info = worker_pb2_grpc.WorkerStub(ch).GetWorkerInfo(
                worker_pb2.GetWorkerInfoRequest(), timeout=10)
        assert (info.max_slots, info.num_pages, info.vocab_size) == (3, 32, 512)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0].decode(errors="replace")
    assert "Traceback" not in out, out


def test_missing_model_flag_is_a_clear_error() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MINISGL_WORKER_MODEL"}
    res = subprocess.run([sys.executable, "-m", "minisgl_worker"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode != 0 and "--model" in res.stderr


def test_grpc_is_loopback_only_by_default() -> None:
    from minisgl_worker.__main__ import build_parser

    ns = build_parser().parse(["--model", "x"])
    assert ns.host == "127.0.0.1" and ns.model_path == "x"
