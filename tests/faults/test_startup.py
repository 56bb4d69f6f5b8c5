"""Start-up in any order: nobody exits because a dependency is not there yet.

The gateway answers /health (liveness) as soon as it runs, while /ready and its gRPC health say
NOT ready until its upstreams are; the scheduler listens with gRPC health NOT_SERVING until its
worker answers, however long that takes (by default; --worker-timeout bounds it). Deployments rely
on readiness, not on exit codes and restarts."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from grpc_health.v1 import health_pb2
from minisgl.launcher import Stack, StackConfig
from minisgl_core.ports import free_port

from tests.gateway.live_stack import ready_status, wait_for

from .chaos import LOAD_PROMPTS, complete, health

pytestmark = pytest.mark.e2e
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def http_status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def test_reverse_start_order_waits_then_serves(tiny_model_path: Path, tmp_path: Path) -> None:
    stack = Stack(StackConfig(
        model_path=str(tiny_model_path), http_port=free_port(), grpc_port=free_port(),
        internal_ports=dict.fromkeys(("worker", "tokenizer", "detokenizer", "scheduler"), 0),
        log_dir=tmp_path, metrics=False))
    sched = stack.target("scheduler")
    try:
        stack._spawn("gateway")
        stack._spawn("scheduler")
        wait_for(lambda: http_status(stack.http_url + "/health") == 200, 60, "gateway alive")
        wait_for(lambda: health(sched) == NOT_SERVING, 60, "scheduler listening, not serving")
        time.sleep(3.0)  # waiting is not a countdown to an exit
        assert all(p.poll() is None for p in stack.processes.values())
        assert health(sched) == NOT_SERVING and health(stack.grpc_target) == NOT_SERVING
        reply = httpx.get(stack.http_url + "/ready", timeout=5)
        assert reply.status_code == 503 and reply.json()["upstreams"]["scheduler"] is False
        refused = httpx.post(stack.http_url + "/v1/completions", json={"prompt": "Hi"}, timeout=5)
        assert refused.status_code == 503, refused.text

        for name in ("worker", "tokenizer", "detokenizer"):
            stack._spawn(name)
        deadline = time.monotonic() + 120
        for name in ("worker", "tokenizer", "detokenizer"):
            stack._wait(name, stack.target(name), deadline)
        up = time.monotonic()
        wait_for(lambda: health(sched) == SERVING, 10, "scheduler serving")
        wait_for(lambda: ready_status(stack.http_url) == 200, 10, "gateway ready")
        wait_for(lambda: health(stack.grpc_target) == SERVING, 10, "gateway gRPC SERVING")
        assert time.monotonic() - up < 5.0
        assert complete(stack.http_url, LOAD_PROMPTS[0]).ok
    finally:
        codes = stack.stop()
    assert all(code == 0 for code in codes.values()), codes


def test_bounded_worker_wait_exits_with_a_clear_error() -> None:
    worker = f"127.0.0.1:{free_port()}"  # nothing listens there
    out = subprocess.run(
        [sys.executable, "-m", "minisgl_scheduler", "--worker", worker, "--worker-timeout", "1",
         "--port", str(free_port()), "--metrics-port", "0"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert f"cannot reach the worker at {worker} within 1s" in out.stderr + out.stdout
