"""Gateway fixtures.

`gw_stack` is the real five-process stack (tests/conftest.py's `stack`). For work on the gateway
alone it can instead be a gateway process in front of real upstreams started elsewhere
(MINISGL_GATEWAY_TEST_UPSTREAMS="tokenizer=H:P,detokenizer=H:P,scheduler=H:P"). Never the default.
`spawn_gateway` starts one more real gateway process, with its own flags, in front of the same
upstreams (API keys, small limits, TLS, drain)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from minisgl_core.ports import free_port
from minisgl_core.serving import wait_for_health

ROOT = Path(__file__).resolve().parents[2]




@dataclass
class GatewayProcess:
    proc: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    log_path: Path
    upstreams: dict[str, str] = field(default_factory=dict)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def target(self, name: str) -> str:
        return self.upstreams[name]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def start_gateway(upstreams: dict[str, str], log_dir: Path, *extra: str,
                  env: dict[str, str] | None = None, timeout: float = 60.0) -> GatewayProcess:
    http, grpc_port = free_port(), free_port()
    log_path = log_dir / f"gateway-{http}.log"
    cmd = [sys.executable, "-m", "minisgl_gateway", "--port", str(http), "--grpc-port",
           str(grpc_port), "--tokenizer", upstreams["tokenizer"], "--detokenizer",
           upstreams["detokenizer"], "--scheduler", upstreams["scheduler"], *extra]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, cwd=ROOT)
    gw = GatewayProcess(proc, http, grpc_port, log_path, dict(upstreams))
    try:
        if "--tls-cert" in extra:
            _wait_for_tls_health(gw, Path(extra[extra.index("--tls-cert") + 1]), timeout)
        else:
            wait_for_health(gw.grpc_target, timeout=timeout)
    except TimeoutError:
        proc.kill()
        raise RuntimeError("gateway did not start:\n" + gw.log()[-3000:]) from None
    return gw


def _wait_for_tls_health(gw: GatewayProcess, cert: Path, timeout: float) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    deadline = time.monotonic() + timeout
    with grpc.secure_channel(gw.grpc_target, creds) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError("TLS gateway not healthy")


@pytest.fixture(scope="session")
def gw_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[object]:
    external = os.environ.get("MINISGL_GATEWAY_TEST_UPSTREAMS", "")
    if not external:
        yield request.getfixturevalue("stack")
        return
    # "tokenizer=HOST:PORT,detokenizer=HOST:PORT,scheduler=HOST:PORT"
    targets = dict(pair.split("=", 1) for pair in external.split(","))
    gw = start_gateway(targets, tmp_path_factory.mktemp("gw"))
    yield gw
    assert gw.stop() == 0


@pytest.fixture(scope="session")
def upstream_targets(gw_stack: object) -> dict[str, str]:
    """Where the stack's tokenizer, detokenizer and scheduler listen."""
    return {n: gw_stack.target(n) for n in ("tokenizer", "detokenizer", "scheduler")}


@pytest.fixture
def spawn_gateway(upstream_targets: dict[str, str], tmp_path: Path
                  ) -> Iterator[Callable[..., GatewayProcess]]:
    started: list[GatewayProcess] = []

    def _spawn(*extra: str, env: dict[str, str] | None = None) -> GatewayProcess:
        gw = start_gateway(upstream_targets, tmp_path, *extra, env=env)
        started.append(gw)
        return gw

    yield _spawn
    for gw in started:
        gw.stop()
