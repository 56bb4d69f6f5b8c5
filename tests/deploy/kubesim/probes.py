"""One probe attempt, as the kubelet makes it: gRPC health, HTTP GET, TCP connect (all against
the pod IP, from the node) or a command inside the container's namespace.

https://kubernetes.io/docs/concepts/configuration/liveness-readiness-startup-probes/ — gRPC:
grpc.health.v1.Health/Check for `service` ('' by default), success only on SERVING; HTTP: any
status in [200, 400); TCP: the connection opens; exec: exit status 0. Each attempt is bounded by
timeoutSeconds.
"""

from __future__ import annotations

import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# The kubelet's defaults for fields a probe leaves out.
DEFAULTS = {"initialDelaySeconds": 0, "periodSeconds": 10, "timeoutSeconds": 1,
            "failureThreshold": 3, "successThreshold": 1}


@dataclass
class Outcome:
    ok: bool
    detail: str


def settings(probe: dict[str, Any]) -> dict[str, int]:
    return {k: int(probe.get(k, v)) for k, v in DEFAULTS.items()}


def resolve_port(port: int | str, container: dict[str, Any]) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"container {container['name']} has no port named {port!r}")


def grpc_probe(ip: str, port: int, service: str, timeout: float) -> Outcome:
    with grpc.insecure_channel(f"{ip}:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return Outcome(False, f"grpc {ip}:{port}: {exc.code().name}")
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return Outcome(reply.status == health_pb2.HealthCheckResponse.SERVING, f"grpc {name}")


def http_probe(ip: str, port: int, path: str, scheme: str, timeout: float) -> Outcome:
    url = f"{scheme.lower()}://{ip}:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:  # noqa: S310 - pod IP
            return Outcome(200 <= reply.status < 400, f"{url}: HTTP {reply.status}")
    except urllib.error.HTTPError as exc:
        return Outcome(200 <= exc.code < 400, f"{url}: HTTP {exc.code}")
    except OSError as exc:
        return Outcome(False, f"{url}: {exc}")


def tcp_probe(ip: str, port: int, timeout: float) -> Outcome:
    try:
        socket.create_connection((ip, port), timeout=timeout).close()
    except OSError as exc:
        return Outcome(False, f"tcp {ip}:{port}: {exc}")
    return Outcome(True, f"tcp {ip}:{port} open")


def attempt(probe: dict[str, Any], ip: str, container: dict[str, Any],
            run_in_pod: Callable[[list[str], float], subprocess.CompletedProcess]) -> Outcome:
    timeout = float(settings(probe)["timeoutSeconds"])
    if "grpc" in probe:
        return grpc_probe(ip, int(probe["grpc"]["port"]), probe["grpc"].get("service", ""),
                          timeout)
    if "httpGet" in probe:
        get = probe["httpGet"]
        return http_probe(get.get("host") or ip, resolve_port(get["port"], container),
                          get.get("path", "/"), get.get("scheme", "HTTP"), timeout)
    if "tcpSocket" in probe:
        return tcp_probe(ip, resolve_port(probe["tcpSocket"]["port"], container), timeout)
    if "exec" in probe:
        try:
            done = run_in_pod(probe["exec"]["command"], timeout)
        except subprocess.TimeoutExpired:
            return Outcome(False, f"exec timed out after {timeout:.0f}s")
        tail = (done.stdout or "").strip().splitlines()[-1:] or [""]
        return Outcome(done.returncode == 0, f"exec rc={done.returncode} {tail[0]}")
    raise ValueError(f"unknown probe {probe}")
