"""A real Prometheus scrapes every service of the running stack."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from minisgl_core.ports import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_shipped_prometheus_config_is_valid() -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool (Debian package prometheus) is not installed")
    result = subprocess.run(["promtool", "check", "config",
                             str(ROOT / "deploy" / "prometheus" / "prometheus.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.request.quote(expr)}"
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.load(reply)["data"]["result"]


def test_prometheus_scrapes_every_service(stack, tmp_path: Path) -> None:
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus (Debian package) is not installed")
    import httpx

    # Some traffic so that the request metrics have samples.
    httpx.post(f"{stack.http_url}/v1/completions",
               json={"prompt": "In the beginning", "max_tokens": 4}, timeout=60)
    targets = {name: f"127.0.0.1:{port}" for name, port in stack.metrics_ports.items()}
    targets["gateway"] = stack.http_url.removeprefix("http://")
    config = {"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": name, "static_configs": [{"targets": [target]}]}
        for name, target in targets.items()]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        up: dict[str, str] = {}
        while time.monotonic() < deadline:
            time.sleep(1)
            try:
                up = {r["metric"]["job"]: r["value"][1] for r in _query(port, "up")}
            except OSError:
                continue
            if len(up) == len(targets) and all(v == "1" for v in up.values()):
                break
        assert up == {name: "1" for name in targets}, up
        running = _query(port, "minisgl_num_requests_running")
        assert running and running[0]["metric"]["job"] == "scheduler"
    finally:
        proc.terminate()
        proc.wait(10)


def test_grafana_dashboard_metrics_exist(stack) -> None:
    """Every `minisgl_` metric the shipped dashboards query is exported by some service."""
    import re

    import httpx

    wanted = {re.sub(r"_(bucket|sum|count)$", "", m)
              for path in (ROOT / "deploy/grafana/dashboards").glob("*.json")
              for panel in json.loads(path.read_text())["panels"] for t in panel["targets"]
              for m in re.findall(r"minisgl_[a-z_]+", t["expr"])}
    assert len(wanted) > 20
    exported = httpx.get(f"{stack.http_url}/metrics", timeout=10).text
    for port in stack.metrics_ports.values():
        exported += httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    missing = sorted(m for m in wanted if m not in exported)
    assert not missing, missing
