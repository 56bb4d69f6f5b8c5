"""`minisgl serve`: five real processes, healthy, serving; SIGTERM stops all of them, no orphan."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from minisgl_core.ports import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> set[int]:
    """All descendants of pid, read from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_serve_starts_all_and_stops_all(tiny_model_path: Path, how: signal.Signals,
                                        tmp_path: Path) -> None:
    http, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "minisgl.cli", "serve", "--model", str(tiny_model_path),
         "--port", str(http), "--grpc-port", str(grpc_port), "--log-level", "warning",
         # service flags given directly (to the scheduler and the worker; to the gateway) and a
         # per-service string beside them
         "--max-prefill-tokens", "1024", "--tool-call-parser", "hermes",
         "--scheduler-args", "--max-running-requests 64"],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "launcher.log", "w"), text=True,  # noqa: SIM115
        env={**os.environ, **{f"MINISGL_{s}_PORT": str(free_port())
                              for s in ("WORKER", "TOKENIZER", "DETOKENIZER", "SCHEDULER")}},
    )
    try:
        deadline = time.monotonic() + 180
        banner = ""
        while "Ctrl-C" not in banner:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, (
                f"launcher exited: {proc.returncode}\n{(tmp_path / 'launcher.log').read_text()[-4000:]}")
            banner += line
            assert time.monotonic() < deadline, banner
        assert f"http://127.0.0.1:{http}" in banner and f"127.0.0.1:{grpc_port}" in banner
        children = _children(proc.pid)
        assert len(children) >= 5, children
        reply = httpx.post(f"http://127.0.0.1:{http}/v1/completions",
                           json={"prompt": "And God said", "max_tokens": 5}, timeout=60)
        assert reply.status_code == 200, reply.text
        proc.send_signal(how)
        # SIGKILL gives the launcher no chance: its children see it die (PR_SET_PDEATHSIG) and drain.
        assert proc.wait(60) == (-signal.SIGKILL if how == signal.SIGKILL else 0)
        deadline = time.monotonic() + 45
        while [c for c in children if _alive(c)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [c for c in children if _alive(c)], "orphaned service processes"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_gateway_replicas_share_the_public_ports(tiny_model_path: Path, tmp_path: Path) -> None:
    """Two gateway processes on one HTTP and one gRPC port: both listen, requests on many
    connections all succeed, and stopping the stack ends every process with exit code 0. A
    gateway started without --reuse-port on a taken port fails instead of sharing it."""
    from minisgl.launcher import Stack, StackConfig, _listening_ports

    http, grpc_port = free_port(), free_port()
    stack = Stack(StackConfig(
        model_path=str(tiny_model_path), http_port=http, grpc_port=grpc_port,
        internal_ports=dict.fromkeys(("worker", "tokenizer", "detokenizer", "scheduler"), 0),
        log_dir=tmp_path, log_level="warning", gateway_replicas=2,
        internal_token=False)).start()  # a gateway of the test's own joins its upstreams
    try:
        gateways = [stack.processes["gateway"], stack.processes["gateway-1"]]
        for p in gateways:
            assert {http, grpc_port} <= (_listening_ports(p.pid) or set())
        for _ in range(6):  # a fresh connection each: the kernel spreads them over both
            reply = httpx.post(f"http://127.0.0.1:{http}/v1/completions",
                               json={"prompt": "In the beginning", "max_tokens": 3}, timeout=60)
            assert reply.status_code == 200, reply.text
        lone = subprocess.run([sys.executable, "-m", "minisgl_gateway", "--port", str(http),
                               "--grpc-port", str(grpc_port),
                               "--tokenizer", stack.target("tokenizer"),
                               "--detokenizer", stack.target("detokenizer"),
                               "--scheduler", stack.target("scheduler"), "--log-level", "error"],
                              capture_output=True, text=True, timeout=120)
        assert lone.returncode != 0 and "bind" in lone.stderr + lone.stdout
    finally:
        codes = stack.stop()
    assert set(codes) == {"worker", "tokenizer", "detokenizer", "scheduler", "gateway",
                          "gateway-1"}
    assert all(c == 0 for c in codes.values()), codes


def test_two_stacks_on_one_host_stay_apart(tiny_model_path: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stacks with the launcher's default internal ports both serve, each on its own
    internal ports with its own token; a third `minisgl serve` on a public port the first holds
    fails at once with one line naming the flag, before it starts any service."""
    from minisgl.launcher import Stack, StackConfig
    from minisgl_core.config import DEFAULT_PORTS

    for service in ("WORKER", "TOKENIZER", "DETOKENIZER", "SCHEDULER"):
        monkeypatch.delenv(f"MINISGL_{service}_PORT", raising=False)

    def start(name: str) -> Stack:
        return Stack(StackConfig(
            model_path=str(tiny_model_path), http_port=free_port(), grpc_port=free_port(),
            log_dir=tmp_path / name, log_level="warning", metrics=False,
            startup_timeout=60)).start()

    first = start("first")
    try:
        second = start("second")
        try:
            internal = ("worker", "tokenizer", "detokenizer", "scheduler")
            ports = [set(s.ports[n] for n in internal) for s in (first, second)]
            assert not ports[0] & ports[1]
            assert not (ports[0] | ports[1]) & {DEFAULT_PORTS[n] for n in internal}
            assert first.token_file and second.token_file
            assert first.token_file.read_text() != second.token_file.read_text()
            for stack in (first, second):
                reply = httpx.post(f"{stack.http_url}/v1/completions", timeout=60,
                                   json={"prompt": "Hi", "max_tokens": 2})
                assert reply.status_code == 200, reply.text
        finally:
            assert all(code == 0 for code in second.stop().values())

        third = subprocess.run(
            [sys.executable, "-m", "minisgl.cli", "serve", "--model", str(tiny_model_path),
             "--port", str(first.config.http_port), "--grpc-port", str(free_port()),
             "--log-format", "text"],
            capture_output=True, text=True, timeout=60)
        assert third.returncode == 1
        errors = [line for line in third.stderr.splitlines() if "ERROR" in line]
        assert len(errors) == 1, third.stderr
        assert f"port {first.config.http_port}" in errors[0] and "--port" in errors[0]
        assert "ready in" not in third.stderr  # no service was started
        reply = httpx.post(f"{first.http_url}/v1/completions", timeout=60,
                           json={"prompt": "Hi", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    finally:
        assert all(code == 0 for code in first.stop().values())
