"""Dashboards, alert rules and their shipping in compose and the Helm chart (static checks)."""

from __future__ import annotations

import json
import runpy
import shutil
import subprocess

import pytest
import yaml

from .test_deploy_configs import CHART, ROOT, render

GEN = runpy.run_path(str(ROOT / "deploy" / "grafana" / "gen_dashboards.py"))
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"


def test_committed_dashboards_are_the_generators_output() -> None:
    for out in GEN["OUTS"]:
        shipped = {p.name: p.read_text() for p in out.glob("*.json")}
        assert shipped == GEN["render"](), f"run deploy/grafana/gen_dashboards.py ({out})"


def test_dashboards_import_anywhere() -> None:
    """A datasource variable instead of a uid; model and instance variables used by the panels."""
    for name in GEN["render"]():
        text = (ROOT / "deploy/grafana/dashboards" / name).read_text()
        board = json.loads(text)
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert {"model_name", "instance"} <= variables.keys()
        uids = {t["datasource"]["uid"] for p in board["panels"] for t in [p, *p["targets"]]}
        assert uids == {"${datasource}"}, uids
        exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
        assert all("$instance" in e for e in exprs), name
        assert any("$model_name" in e for e in exprs), name


def test_chart_rules_are_the_shipped_rules() -> None:
    assert (CHART / "files" / "rules.yml").read_text() == RULES.read_text()


def test_promtool_rules_tests_pass() -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool (Debian package prometheus) is not installed")
    for args in (["check", "rules", str(RULES)],
                 ["test", "rules", str(ROOT / "tests/deploy/data/rules_test.yml")]):
        result = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr


def test_compose_prometheus_loads_the_rules() -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert config["rule_files"] == ["rules.yml"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = compose["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus/rules.yml:/etc/prometheus/rules.yml:ro" in mounts
    for name in ("gateway", "tokenizer", "detokenizer", "scheduler", "worker"):
        env = compose["services"][name]["environment"]
        assert env["MINISGL_METRICS_COMPAT"] == "${MINISGL_METRICS_COMPAT:-off}", name
    grafana = compose["services"]["grafana"]["volumes"]
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana


def test_chart_ships_dashboards_rules_and_compat_env() -> None:
    values = {"grafanaDashboards": {"enabled": True}, "prometheusRule": {"enabled": True},
              "metrics": {"compat": "vllm"}}
    docs = [d for v in render(values).values() for d in v]
    [config_map] = [d for d in docs if d["kind"] == "ConfigMap"
                    and d["metadata"]["name"].endswith("-dashboards")]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert {k: json.loads(v) for k, v in config_map["data"].items()} == {
        f"minisgl-{k}": json.loads(v) for k, v in GEN["render"]().items()}
    [rule] = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    containers = [c for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                  for c in d["spec"]["template"]["spec"]["containers"]]
    assert {c["name"] for c in containers} >= {"gateway", "scheduler", "worker", "tokenizer"}
    for c in containers:
        assert {"name": "MINISGL_METRICS_COMPAT", "value": "vllm"} in c["env"], c["name"]
    off = [d for v in render({}).values() for d in v]
    assert not [d for d in off if d["kind"] == "PrometheusRule"]
    assert not [d for d in off if d["metadata"]["name"].endswith("-dashboards")]
