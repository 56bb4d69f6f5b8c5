"""The stand-in kubelet: `python -m tests.deploy.kubesim.kubelet PLAN.json RESULT.json`, run
inside the node's network namespace (test_chart_kubelet.py sets the namespaces up).

Per container, as the kubelet does: start it; run its startupProbe every periodSeconds (after
initialDelaySeconds) until it succeeds, restarting the container after failureThreshold failures
in a row; only then run livenessProbe (restart after failureThreshold failures) and
readinessProbe (Ready after successThreshold successes, unready after failureThreshold
failures); restart a container that exits, with back-off. A pod is Ready when all its
containers are. Once every pod is Ready (or the deadline passes) it sends a completion to the
gateway Service's name, runs the `helm test` pods, scrapes what the ServiceMonitors select, and
stops every pod as the kubelet does: preStop hook, SIGTERM, SIGKILL at the grace period's end.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import probes
from .cluster import ClusterPlan, PodPlan
from .runtime import Container, containers_of, image_entrypoints


@dataclass
class State:
    container: Container
    started: bool = False        # the startup probe passed (or there is none)
    ready: bool = False
    restarts: int = 0
    events: list[str] = field(default_factory=list)
    last: dict[str, str] = field(default_factory=dict)  # probe kind -> last outcome
    lock: threading.Lock = field(default_factory=threading.Lock)  # one restart at a time


class Kubelet:
    def __init__(self, cluster: ClusterPlan, workdir: Path) -> None:
        self.cluster = cluster
        self.t0 = time.monotonic()
        self.entrypoints = image_entrypoints()
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.states: list[State] = []
        self.workdir = workdir

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, state: State, text: str) -> None:
        with self.lock:
            state.events.append(f"{self.now():6.1f}s {text}")

    # --- one container's life ---------------------------------------------------------------

    def start(self, state: State) -> None:
        state.started = not state.container.spec.get("startupProbe")
        state.ready = False
        state.container.start(self.entrypoints)
        self.note(state, f"started pid {state.container.proc.pid}")

    def restart(self, state: State, why: str, proc: subprocess.Popen | None) -> None:
        """Restart the container if `proc` is still its process (a failed probe and the exit
        watcher may both ask for the same restart)."""
        with state.lock:
            if state.container.proc is not proc or self.stopping.is_set():
                return
            self.note(state, f"restart: {why}")
            state.container.kill()
            state.restarts += 1
            time.sleep(min(10 * 2 ** (state.restarts - 1), 60))  # the kubelet's back-off
            if not self.stopping.is_set():
                self.start(state)

    def probe_loop(self, state: State, kind: str) -> None:
        c = state.container
        probe = c.spec.get(kind)
        if not probe:
            return
        s = probes.settings(probe)
        while not self.stopping.is_set():
            generation = state.restarts
            if kind != "startupProbe":
                while not state.started and not self.stopping.wait(0.2):
                    pass
            if self.stopping.wait(s["initialDelaySeconds"]):
                return
            failures = successes = 0
            while not self.stopping.is_set() and generation == state.restarts:
                if kind == "startupProbe" and state.started:
                    break
                begun = time.monotonic()
                proc = c.proc
                try:
                    out = probes.attempt(probe, c.pod.ip, c.spec, c.run_in_pod)
                except Exception as exc:  # a probe that cannot even be made counts as failed
                    out = probes.Outcome(False, f"{type(exc).__name__}: {exc}")
                state.last[kind] = out.detail
                failures, successes = (0, successes + 1) if out.ok else (failures + 1, 0)
                if kind == "startupProbe" and out.ok:
                    state.started = True
                    self.note(state, f"startup probe passed ({out.detail})")
                elif kind == "readinessProbe":
                    if out.ok and successes >= s["successThreshold"] and not state.ready:
                        state.ready = True
                        self.note(state, f"ready ({out.detail})")
                    elif not out.ok and failures >= s["failureThreshold"] and state.ready:
                        state.ready = False
                        self.note(state, f"unready ({out.detail})")
                elif not out.ok and failures >= s["failureThreshold"]:
                    self.restart(state, f"{kind} failed {failures}x: {out.detail}", proc)
                    break
                self.stopping.wait(max(0.0, s["periodSeconds"] - (time.monotonic() - begun)))
            if kind == "startupProbe" and state.started:
                # Wait for a restart, which runs the startup probe again.
                generation = state.restarts
                while generation == state.restarts and not self.stopping.wait(0.5):
                    pass

    def watch_exit(self, state: State) -> None:
        while not self.stopping.wait(0.5):
            proc = state.container.proc
            if proc is not None and proc.poll() is not None and not self.stopping.is_set():
                self.restart(state, f"exited with {proc.returncode}", proc)

    def is_ready(self, state: State) -> bool:
        spec = state.container.spec
        running = state.container.proc is not None and state.container.proc.poll() is None
        return running and state.started and (state.ready if spec.get("readinessProbe") else True)

    # --- the cluster ------------------------------------------------------------------------

    def run_init(self, pod: PodPlan) -> None:
        for init in containers_of(pod, self.cluster, self.workdir / pod.name, "initContainers"):
            init.start(self.entrypoints)
            if init.proc.wait(timeout=300) != 0:
                raise RuntimeError(f"init container {init.name} failed:\n{init.log_tail()}")

    def launch(self) -> None:
        for pod in self.cluster.pods:
            if pod.hook:
                continue
            self.run_init(pod)
            for c in containers_of(pod, self.cluster, self.workdir / pod.name):
                state = State(c)
                self.states.append(state)
                self.start(state)
                for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                    threading.Thread(target=self.probe_loop, args=(state, kind),
                                     daemon=True).start()
                threading.Thread(target=self.watch_exit, args=(state,), daemon=True).start()

    def wait_ready(self, deadline_s: float) -> bool:
        while self.now() < deadline_s:
            if all(self.is_ready(s) for s in self.states):
                return True
            time.sleep(0.5)
        return False

    def terminate(self) -> dict[str, dict[str, Any]]:
        """preStop, then SIGTERM, SIGKILL once terminationGracePeriodSeconds have passed."""
        self.stopping.set()
        results: dict[str, dict[str, Any]] = {}

        def stop(state: State) -> None:
            c = state.container
            grace = int(c.pod.spec.get("terminationGracePeriodSeconds", 30))
            begun = time.monotonic()
            hook = c.spec.get("lifecycle", {}).get("preStop", {}).get("exec")
            if hook:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.run_in_pod(hook["command"], grace)
            c.signal(signal.SIGTERM)
            try:
                code = c.proc.wait(timeout=max(0.0, grace - (time.monotonic() - begun)))
                killed = False
            except subprocess.TimeoutExpired:
                c.kill()
                code, killed = c.proc.returncode, True
            results[c.name] = {"exit": code, "killed": killed, "grace_s": grace,
                               "took_s": round(time.monotonic() - begun, 1)}

        threads = [threading.Thread(target=stop, args=(s,)) for s in self.states]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


def completion_via_service(cluster: ClusterPlan) -> dict[str, Any]:
    """What a client inside the cluster does: the gateway Service's name, its HTTP port."""
    name, svc = next((n, s) for n, s in cluster.services.items() if n.endswith("-gateway"))
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
    base = f"http://{name}:{port}"
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as reply:
        model = json.load(reply)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 8}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return {"url": base, "status": reply.status, "body": json.load(reply)}


def scrape_monitors(cluster: ClusterPlan) -> list[dict[str, Any]]:
    """Prometheus' view of each ServiceMonitor: Services by label, endpoints by port name,
    every pod behind the Service scraped at the port its Service port targets."""
    out = []
    pods = {p.ip: p for p in cluster.pods}
    for monitor in cluster.service_monitors:
        selector = monitor["spec"]["selector"]["matchLabels"]
        for name, svc in cluster.services.items():
            labels = svc["metadata"].get("labels", {})
            if not all(labels.get(k) == v for k, v in selector.items()):
                continue
            for endpoint in monitor["spec"]["endpoints"]:
                port = next(p for p in svc["spec"]["ports"] if p.get("name") == endpoint["port"])
                for ip in cluster.service_ips[name]:
                    target = port.get("targetPort", port["port"])
                    container = next(c for c in pods[ip].spec["containers"]
                                     if any(cp.get("name") == target or cp["containerPort"] == target
                                            for cp in c.get("ports", [])))
                    number = probes.resolve_port(target, container)
                    outcome = probes.http_probe(ip, number, endpoint.get("path", "/metrics"),
                                                "HTTP", 5)
                    out.append({"monitor": monitor["metadata"]["name"], "service": name,
                                "port": endpoint["port"], "target": f"{ip}:{number}",
                                "ok": outcome.ok, "detail": outcome.detail})
    return out


def run_hooks(kubelet: Kubelet) -> list[dict[str, Any]]:
    results = []
    for pod in kubelet.cluster.pods:
        if not pod.hook:
            continue
        for c in containers_of(pod, kubelet.cluster, kubelet.workdir / pod.name):
            c.start(kubelet.entrypoints)
            try:
                code = c.proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                c.kill()
                code = None
            results.append({"pod": pod.name, "exit": code, "log": c.log_tail(5)})
    return results


def main(plan_path: str, result_path: str, deadline_s: float) -> int:
    cluster = ClusterPlan.from_json(json.loads(Path(plan_path).read_text()))
    kubelet = Kubelet(cluster, Path(result_path).parent / "pods")
    result: dict[str, Any] = {}
    try:
        kubelet.launch()
        result["all_ready"] = kubelet.wait_ready(deadline_s)
        result["ready_after_s"] = round(kubelet.now(), 1)
        if result["all_ready"]:
            try:
                result["completion"] = completion_via_service(cluster)
            except Exception as exc:
                result["completion"] = {"error": f"{type(exc).__name__}: {exc}"}
            result["hooks"] = run_hooks(kubelet)
            result["scrapes"] = scrape_monitors(cluster)
    finally:
        result["containers"] = {
            s.container.name: {"ready": kubelet.is_ready(s), "started": s.started,
                               "restarts": s.restarts, "events": s.events, "last": s.last,
                               "log": s.container.log_tail()}
            for s in kubelet.states}
        result["termination"] = kubelet.terminate()
        Path(result_path).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
