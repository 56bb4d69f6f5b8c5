"""The Helm chart's pods become Ready when run the way the kubelet runs them.

No cluster exists here, so tests/deploy/kubesim stands in for one node: every pod of the rendered
chart gets its own network namespace and IP on a bridge, Service names resolve to pod IPs
through each namespace's /etc/hosts, each container's real command and args run from this
checkout's venv with the container's env, mounts and user, and every startup, liveness and
readiness probe runs as the kubelet runs it (gRPC/HTTP/TCP against the pod IP, exec inside the
pod) with the manifest's timings. Then a completion goes to the gateway Service's name, the
chart's `helm test` pod runs, every ServiceMonitor target is scraped, and the pods are stopped
through preStop + SIGTERM within their grace periods.

GPU values files run with a CPU stand-in for the CUDA worker (kubesim/runtime.py: --device=cpu,
the tiny model; for TP=8 random weights of the tiny model widened to 8 heads, as its 4 heads
cannot split 8 ways) and their front tiers at one replica to keep the run short.

MINISGL_CHART_DIR=<dir> runs the same checks against another copy of the chart.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from .kubesim import cluster, netns
from .kubesim.runtime import PYTHON, ROOT

CHART = Path(os.environ.get("MINISGL_CHART_DIR", ROOT / "deploy" / "k8s" / "minisgl"))
ONE_EACH = {"gateway": {"replicas": 1, "autoscaling": {"enabled": False}},
            "tokenizer": {"replicas": 1, "autoscaling": {"enabled": False}},
            "detokenizer": {"replicas": 1}}


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


CASES: dict[str, tuple[str | None, dict[str, Any], float]] = {
    # name: (values file, overrides, seconds the pods get to become Ready)
    "default": (None, {"serviceMonitor": {"enabled": True}}, 150),
    "gpu": ("values-gpu.yaml", ONE_EACH, 150),
    "tp2": ("values-tp2.yaml", ONE_EACH, 150),
    "tp8": ("values-tp8.yaml", ONE_EACH, 200),
    # What mTLS switches to: every gRPC probe an exec of minisgl_core.healthcheck in the pod.
    "exec-probes": (None, merge(ONE_EACH, {"probes": {"exec": True}}), 150),
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    helm = pytest.importorskip("helm_python")
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="t", namespace="default")
    return [d for name, text in manifests.items() if not name.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]


def _explain(result: dict[str, Any]) -> str:
    lines = []
    for name, c in result.get("containers", {}).items():
        if c["ready"] and not c["restarts"]:
            continue
        lines.append(f"--- {name}: ready={c['ready']} started={c['started']} "
                     f"restarts={c['restarts']}")
        lines += [f"    last {kind}: {detail}" for kind, detail in c["last"].items()]
        lines += [f"    {e}" for e in c["events"][-6:]]
        lines += [f"    | {line}" for line in c["log"].splitlines()[-6:]]
    return "\n".join(lines)


@pytest.mark.timeout(900)  # the run bounds itself: deadline, then grace periods
@pytest.mark.parametrize("case", list(CASES))
def test_chart_pods_become_ready_and_serve(case: str, tmp_path: Path) -> None:
    reason = netns.can_create_namespaces()
    if reason:
        pytest.skip(f"cannot run pods in network namespaces here: {reason}")
    values_file, overrides, deadline = CASES[case]
    values = yaml.safe_load((CHART / values_file).read_text()) if values_file else {}
    values = merge(values, overrides)
    prefix = f"k{os.getpid() % 100000}{list(CASES).index(case)}"
    subnet = f"10.{200 + list(CASES).index(case)}.{os.getpid() % 250}"
    plan = cluster.plan(render(values), "default", prefix, subnet)
    assert [p for p in plan.pods if not p.hook], "the chart renders no pods"
    # The pods' volumes (Secrets, emptyDirs) live here: it must be traversable by the containers'
    # non-root users, which pytest's own 0700 tmp_path is not.
    work = Path(tempfile.mkdtemp(prefix=f"kubesim-{case}-"))
    work.chmod(0o711)
    network = netns.Network(prefix, subnet)
    try:
        network.up()
        for pod in plan.pods:
            network.attach(pod.netns, pod.ip)
        network.write_hosts(plan.hosts())
        (work / "plan.json").write_text(json.dumps(plan.to_json()))
        run = subprocess.run(
            ["ip", "netns", "exec", network.node, PYTHON, "-m", "tests.deploy.kubesim.kubelet",
             str(work / "plan.json"), str(work / "result.json"), str(deadline)],
            cwd=ROOT, capture_output=True, text=True, timeout=deadline + 300)
        result_text = (work / "result.json").read_text() if run.returncode == 0 else ""
    finally:
        network.down()
        shutil.copytree(work, tmp_path / "kubesim", dirs_exist_ok=True)  # logs stay for a look
        shutil.rmtree(work, ignore_errors=True)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(result_text)

    assert result["all_ready"], (
        f"not every pod Ready after {deadline:.0f}s:\n{_explain(result)}")
    restarted = {n: c["restarts"] for n, c in result["containers"].items() if c["restarts"]}
    assert not restarted, f"containers restarted:\n{_explain(result)}"
    completion = result["completion"]
    assert "error" not in completion, completion
    assert completion["body"]["usage"]["completion_tokens"] > 0, completion
    hooks = result["hooks"]
    assert hooks and all(h["exit"] == 0 for h in hooks), hooks
    if case == "default":
        scraped = {(s["service"].rsplit("-", 1)[-1], s["port"]) for s in result["scrapes"]}
        assert {("gateway", "http"), ("tokenizer", "metrics"), ("detokenizer", "metrics"),
                ("engine", "metrics"), ("engine", "worker-metrics")} <= scraped, scraped
        failed = [s for s in result["scrapes"] if not s["ok"]]
        assert not failed, failed
    stuck = {n: t for n, t in result["termination"].items() if t["killed"] or t["exit"] != 0}
    assert not stuck, f"containers not stopped cleanly within their grace period: {stuck}"
