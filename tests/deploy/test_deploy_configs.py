"""The Helm chart and docker-compose file render, and every flag they pass exists in the service."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "k8s" / "minisgl"
MODULES = {  # container/service name -> how it is started
    "gateway": ["minisgl_gateway"],
    "tokenizer": ["minisgl_tokenizer", "tokenizer"],
    "detokenizer": ["minisgl_tokenizer", "detokenizer"],
    "scheduler": ["minisgl_scheduler"],
    "worker": ["minisgl_worker"],
}


@functools.cache
def service_help(service: str) -> str:
    result = subprocess.run([sys.executable, "-m", *MODULES[service], "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def assert_flags_exist(service: str, args: list[str]) -> None:
    text = service_help(service)
    for arg in args:
        match = re.match(r"(--[a-z0-9-]+)", str(arg))
        if match:
            assert match.group(1) in text, f"{service} has no flag {match.group(1)}"


def render(values: dict) -> dict[str, list[dict]]:
    helm = pytest.importorskip("helm_python")
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="t", namespace="default")
    return {k: [d for d in yaml.safe_load_all(v) if d] for k, v in manifests.items()}


def test_chart_lints_clean() -> None:
    helm = pytest.importorskip("helm_python")
    report = helm.lint(str(CHART))
    assert report["errors"] == [], report
    assert not [m for m in report["messages"] if m["severity"] > 1], report


@pytest.mark.parametrize("values_file", [None, "values-tp8.yaml"])
def test_chart_renders_with_real_flags(values_file: str | None) -> None:
    values = yaml.safe_load((CHART / values_file).read_text()) if values_file else {}
    docs = [d for ds in render(values).values() for d in ds]
    deployments = {d["metadata"]["name"].rsplit("-", 1)[-1]: d for d in docs
                   if d["kind"] == "Deployment"}
    assert set(deployments) == {"gateway", "tokenizer", "detokenizer", "engine"}
    for deployment in deployments.values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            args = [a for a in container.get("args", []) if a not in MODULES]
            assert_flags_exist(container["name"], args)
    # Tokenize calls spread over the tokenizer pods: a headless Service, resolved by grpc's DNS
    # resolver into one address per pod (the gateway's tokenizer channel is round robin).
    services = {d["metadata"]["name"].rsplit("-", 1)[-1]: d for d in docs if d["kind"] == "Service"}
    assert services["tokenizer"]["spec"].get("clusterIP") == "None"
    gateway = deployments["gateway"]["spec"]["template"]["spec"]["containers"][0]
    tokenizer_arg = next(a for a in gateway["args"] if a.startswith("--tokenizer="))
    name = services["tokenizer"]["metadata"]["name"]
    port = services["tokenizer"]["spec"]["ports"][0]["port"]
    assert tokenizer_arg == f"--tokenizer=dns:///{name}:{port}"
    if values_file == "values-tp8.yaml":
        worker = next(c for c in deployments["engine"]["spec"]["template"]["spec"]["containers"]
                      if c["name"] == "worker")
        assert "--tp-size=8" in worker["args"]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 8
        env = {e["name"]: e["value"] for e in worker["env"]}
        assert env["NCCL_NVLS_ENABLE"] == "0"


def test_compose_services_use_real_flags() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name in MODULES:
        command = [a for a in services[name]["command"] if a not in ("tokenizer", "detokenizer")]
        assert_flags_exist(name, command)
    for mount in services["prometheus"]["volumes"] + services["envoy"]["volumes"]:
        if mount.startswith("./"):  # a bind mount of the repository (others are named volumes)
            assert (ROOT / mount.split(":")[0]).exists(), mount


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_compose_gateway_replicas_are_all_reached() -> None:
    """Envoy and Prometheus must see every gateway replica, on the ports the gateway listens on:
    Envoy through STRICT_DNS clusters (all addresses of the name), Prometheus through DNS-SD."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    gateway = compose["services"]["gateway"]
    http_port, grpc_port = (int(_flag(gateway["command"], f)) for f in ("--port", "--grpc-port"))
    assert gateway.get("deploy", {}).get("replicas", 1) >= 2
    envoy = yaml.safe_load((ROOT / "deploy/envoy/envoy.yaml").read_text())
    clusters = {c["name"]: c for c in envoy["static_resources"]["clusters"]}
    for name, port in (("gateway_http", http_port), ("gateway_grpc", grpc_port)):
        cluster = clusters[name]
        assert cluster["type"] == "STRICT_DNS"
        [endpoint] = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        address = endpoint["endpoint"]["address"]["socket_address"]
        assert (address["address"], address["port_value"]) == ("gateway", port)
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    sd = [c for job in prometheus["scrape_configs"] for c in job.get("dns_sd_configs", [])]
    assert {"names": ["gateway"], "port": http_port} in [
        {"names": c["names"], "port": c["port"]} for c in sd]
    static = [t for job in prometheus["scrape_configs"] for c in job.get("static_configs", [])
              for t in c["targets"]]
    assert not [t for t in static if t.startswith("gateway:")], "a static target hits one replica"


def test_grafana_dashboard_is_generated_from_script() -> None:
    import json
    import runpy

    build = runpy.run_path(str(ROOT / "scripts" / "gen_grafana_dashboard.py"))["build"]
    shipped = json.loads((ROOT / "deploy/grafana/dashboards/minisgl.json").read_text())
    assert shipped == build(), "run scripts/gen_grafana_dashboard.py"
