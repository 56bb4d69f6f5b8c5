"""Helpers for failure tests against real service processes: kill one service of a running
`minisgl.launcher.Stack` and start it again on the same port, poll the scheduler's load, read SSE
events, make a self-signed certificate. Nothing here stands in for a service."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest
from minisgl.launcher import Stack
from minisgl_core.proto.minisgl.v1 import scheduler_pb2, scheduler_pb2_grpc
from minisgl_core.security import InternalSecurity
from minisgl_core.serving import wait_for_health

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Like the launcher's children: a restarted service must not outlive the test process.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class LiveStack:
    """A started Stack whose tokenizer, detokenizer and scheduler may be killed and restarted.

    A restart runs the service's original command line (plus `extra` flags, argparse's last value
    wins), so it listens on the same port and the gateway has to find it again by itself."""

    def __init__(self, stack: Stack, log_dir: Path) -> None:
        self.stack = stack
        self.log_dir = log_dir
        self.commands = {name: list(proc.args) for name, proc in stack.processes.items()}
        self._logs: list[IO[bytes]] = []
        self._restarts = 0

    @property
    def http_url(self) -> str:
        return self.stack.http_url

    @property
    def grpc_target(self) -> str:
        return self.stack.grpc_target

    def target(self, name: str) -> str:
        return self.stack.target(name)

    def kill(self, name: str) -> None:
        """SIGKILL: no drain, no goodbye; the sockets close when the process is gone."""
        proc = self.stack.processes[name]
        proc.kill()
        proc.wait(10)

    def restart(self, name: str, *extra: str, timeout: float = 60.0) -> None:
        proc = self.stack.processes[name]
        if proc.poll() is None:  # a running service is stopped cleanly first
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, f"{name} did not drain cleanly"
        self._restarts += 1
        log = open(self.log_dir / f"{name}-{self._restarts}.log", "wb")  # noqa: SIM115
        self._logs.append(log)
        new = subprocess.Popen(self.commands[name] + list(extra), stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=_die_with_parent,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.stack.processes[name] = new
        try:
            wait_for_health(self.target(name), timeout=timeout)
        except TimeoutError:
            raise RuntimeError(f"{name} did not come back:\n"
                               + Path(log.name).read_text(errors="replace")[-3000:]) from None

    def stop(self) -> dict[str, int | None]:
        codes = self.stack.stop()
        for log in self._logs:
            log.close()
        return codes


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not reached in {timeout:.0f}s: {what}"
        time.sleep(0.02)


def scheduler_load(target: str, token_file: Path | None = None) -> scheduler_pb2.GetLoadResponse:
    """The scheduler's load; `token_file`: the internal token of a stack that has one."""
    security = InternalSecurity.load(str(token_file)) if token_file else InternalSecurity()
    with security.sync_channel(target, []) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).GetLoad(
            scheduler_pb2.GetLoadRequest(), timeout=10)


def idle(target: str, token_file: Path | None = None) -> bool:
    """No request running or waiting and no KV page held by one (prefix-cache pages aside)."""
    load = scheduler_load(target, token_file)
    return (load.running_requests, load.waiting_requests, load.used_pages) == (0, 0, 0)


def sse_events(reply: httpx.Response) -> Iterator[dict | str]:
    for line in reply.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


def ready_status(base_url: str) -> int:
    return httpx.get(base_url + "/ready", timeout=5).status_code


def make_self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (cert.pem, key.pem), made with the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed; cannot make a test certificate")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key
