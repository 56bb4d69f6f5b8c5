"""Dashboards against a real Prometheus scraping the stack in `--metrics-compat vllm` mode.

vLLM's published dashboard (an excerpt with its queries: data/vllm_grafana.json, Apache-2.0, see
data/NOTICE.vllm) and our generated ones (deploy/grafana/dashboards): with traffic flowing, every
query returns data, each series a finite number.
"""

from __future__ import annotations

import json
import math
import runpy
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from minisgl.launcher import Stack, StackConfig
from minisgl_core.ports import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
RATE_INTERVAL = "30s"  # what Grafana's $__rate_interval is at a 1 s scrape interval, rounded up


@pytest.fixture(scope="module")
def compat_stack(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = StackConfig(
        model_path=str(tiny_model_path), http_port=free_port(), grpc_port=free_port(),
        internal_ports={"worker": 0, "tokenizer": 0, "detokenizer": 0, "scheduler": 0},
        log_dir=tmp_path_factory.mktemp("compat-logs"), log_level="info", internal_token=False,
        env={"MINISGL_METRICS_COMPAT": "vllm"})
    stack = Stack(config).start()
    try:
        yield stack
    finally:
        stack.stop()


def _api(port: int, path: str, **params: str) -> object:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.load(reply)["data"]


@pytest.fixture(scope="module")
def prometheus(compat_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus (Debian package) is not installed")
    tmp = tmp_path_factory.mktemp("prometheus")
    targets = {name: f"127.0.0.1:{port}" for name, port in compat_stack.metrics_ports.items()}
    targets["gateway"] = compat_stack.http_url.removeprefix("http://")
    config = {"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": name, "static_configs": [{"targets": [target]}]}
        for name, target in targets.items()]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def traffic(compat_stack: Stack) -> Iterator[None]:
    """Requests without pause (streamed, unary, n=2) so that every rate() stays above zero."""
    stop = threading.Event()

    def run() -> None:
        bodies = [{"prompt": "In the beginning", "max_tokens": 8, "stream": True},
                  {"prompt": "And God said", "max_tokens": 6, "n": 2},
                  {"prompt": "In the beginning God created", "max_tokens": 5}]
        with httpx.Client(base_url=compat_stack.http_url, timeout=60) as client:
            while not stop.is_set():
                for body in bodies:
                    client.post("/v1/completions", json=body).raise_for_status()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(60)


def _exprs(path: Path) -> list[str]:
    board = json.loads(path.read_text())
    return [t["expr"] for p in board["panels"] for t in p["targets"]]


def _wait_for_data(port: int, exprs: list[str], timeout: float = 90.0) -> None:
    pending = list(exprs)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        time.sleep(1)

        def has_data(expr: str) -> bool:
            try:
                result = _api(port, "query", query=expr)["result"]  # type: ignore[index]
            except OSError:
                return False
            return bool(result) and all(math.isfinite(float(r["value"][1])) for r in result)

        pending = [e for e in pending if not has_data(e)]
    assert not pending, f"no data for {pending}"


def test_vllm_dashboard_queries_return_data(compat_stack: Stack, prometheus: int,
                                            traffic: None) -> None:
    exprs = _exprs(DATA / "vllm_grafana.json")
    assert len(exprs) >= 25
    # The dashboard's model_name variable: label_values({__name__=~"vllm:.*"}, model_name).
    models: list[str] = []
    deadline = time.monotonic() + 60
    while not models and time.monotonic() < deadline:
        time.sleep(1)
        try:
            models = _api(prometheus, "label/model_name/values",  # type: ignore[assignment]
                          **{"match[]": '{__name__=~"vllm:.*"}'})
        except OSError:
            continue
    assert len(models) == 1, models  # every tier labels the same model name
    _wait_for_data(prometheus, [e.replace("$model_name", models[0])
                                .replace("$__rate_interval", RATE_INTERVAL) for e in exprs])


def test_our_dashboards_queries_return_data(compat_stack: Stack, prometheus: int,
                                            traffic: None) -> None:
    expand = runpy.run_path(str(ROOT / "deploy/grafana/gen_dashboards.py"))["expand"]
    exprs = [expand(e, RATE_INTERVAL)
             for path in sorted((ROOT / "deploy/grafana/dashboards").glob("*.json"))
             for e in _exprs(path)]
    assert len(exprs) >= 40
    _wait_for_data(prometheus, exprs)


def test_compat_names_are_off_by_default(stack: Stack) -> None:
    """The shared stack runs without compat mode: no vllm: names, ours with model_name."""
    text = httpx.get(f"http://127.0.0.1:{stack.metrics_ports['scheduler']}/metrics",
                     timeout=10).text
    assert "vllm:" not in text
    assert "minisgl_num_requests_running{model_name=" in text
