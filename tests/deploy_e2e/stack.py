"""The running Compose stack the deployment test talks to: its project name, host ports and the
`docker compose` / `docker` calls the tests make. scripts/deploy/test_deploy.sh starts the stack
and exports the environment read here."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# Our services and the gRPC port each one's health service answers on inside its container.
GRPC_SERVICES = {"tokenizer": 50061, "detokenizer": 50062, "scheduler": 50063, "worker": 50064,
                 "gateway": 50051}


@dataclass(frozen=True)
class Stack:
    project: str
    http_port: int
    prometheus_port: int

    @classmethod
    def from_env(cls) -> Stack:
        return cls(project=os.environ.get("COMPOSE_PROJECT_NAME", "minisgl-e2e"),
                   http_port=int(os.environ.get("MINISGL_HTTP_PORT", "8080")),
                   prometheus_port=int(os.environ.get("MINISGL_PROMETHEUS_PORT", "9090")))

    @property
    def edge(self) -> str:
        """Envoy, the only way in: OpenAI HTTP and gRPC on one port."""
        return f"127.0.0.1:{self.http_port}"

    def compose(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        result = subprocess.run(
            ["docker", "compose", "-p", self.project, "--profile", "cpu", *args],
            cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)}: {result.stderr}")
        return result.stdout

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).split()

    def inspect(self, container: str) -> dict[str, Any]:
        out = subprocess.run(["docker", "inspect", container], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        return json.loads(out)[0]

    def labelled(self, kind: str) -> list[str]:
        """IDs of this project's containers / networks / volumes (`kind`), running or not."""
        args = ["docker", kind, "ls", "-q", "--filter",
                f"label=com.docker.compose.project={self.project}"]
        if kind == "container":
            args.insert(3, "-a")
        return subprocess.run(args, capture_output=True, text=True, timeout=30,
                              check=True).stdout.split()

    def prometheus(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.prometheus_port}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]


def wait_until(what: str, check: Any, timeout: float, interval: float = 1.0) -> Any:
    """Polls `check()` until it returns something truthy; fails naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as exc:  # noqa: BLE001 - retried until the deadline, then reported
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} not within {timeout:.0f}s (last: {last!r})")
