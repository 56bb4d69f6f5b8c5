"""The Helm chart and docker-compose file render, and every flag they pass exists in the service."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from . import chart_checks

ROOT = Path(__file__).resolve().parents[2]
# MINISGL_CHART_DIR=<dir>: check another copy of the chart (e.g. an older commit's).
CHART = Path(os.environ.get("MINISGL_CHART_DIR", ROOT / "deploy" / "k8s" / "minisgl"))
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
    return {k: [d for d in yaml.safe_load_all(v) if d] for k, v in manifests.items()
            if not k.endswith("NOTES.txt")}


def test_chart_lints_clean() -> None:
    helm = pytest.importorskip("helm_python")
    report = helm.lint(str(CHART))
    assert report["errors"] == [], report
    assert not [m for m in report["messages"] if m["severity"] > 1], report


VALUES_FILES = [None, "values-gpu.yaml", "values-tp2.yaml", "values-tp8.yaml"]


def values_of(values_file: str | None) -> dict:
    return yaml.safe_load((CHART / values_file).read_text()) if values_file else {}


def docs_of(values: dict) -> list[dict]:
    return [d for ds in render(values).values() for d in ds]


def pods_of(docs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """component -> (pod spec, pod labels), for every Deployment and the helm test pod."""
    out = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            template = d["spec"]["template"]
            out[d["metadata"]["name"].rsplit("-", 1)[-1]] = (template["spec"],
                                                             template["metadata"]["labels"])
        elif d["kind"] == "Pod":
            out["test"] = (d["spec"], d["metadata"]["labels"])
    return out


def pod_templates(docs: list[dict]) -> dict[str, dict]:
    return {component: spec for component, (spec, _) in pods_of(docs).items()}


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_chart_renders_with_real_flags(values_file: str | None) -> None:
    docs = docs_of(values_of(values_file))
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
    worker = next(c for c in deployments["engine"]["spec"]["template"]["spec"]["containers"]
                  if c["name"] == "worker")
    if values_file is not None:  # every GPU layout: CUDA image, one GPU per TP rank
        tp = values_of(values_file)["engine"]["worker"]["tensorParallel"]
        assert f"--tp-size={tp}" in worker["args"]
        assert worker["image"] == "minisgl/worker-cuda:0.1.0"
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == tp
        env = {e["name"]: e["value"] for e in worker["env"]}
        assert env["NCCL_NVLS_ENABLE"] == "0"
    else:
        assert worker["image"] == "minisgl/worker-cpu:0.1.0"
        assert "nvidia.com/gpu" not in worker["resources"]["limits"]


def test_gpu_true_alone_gives_a_gpu_engine() -> None:
    docs = docs_of({"engine": {"worker": {"gpu": True, "tensorParallel": 2}}})
    engine = pod_templates(docs)["engine"]
    worker = next(c for c in engine["containers"] if c["name"] == "worker")
    assert worker["image"] == "minisgl/worker-cuda:0.1.0"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        engine["tolerations"]


# Every optional branch of the templates at once.
EVERYTHING_ON = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
    "engine": {"autoscaling": {"enabled": True}, "worker": {"gpu": True, "tensorParallel": 2},
               "runtimeClassName": "nvidia", "priorityClassName": "inference"},
    "model": {"path": "/models/Qwen3-8B", "initContainer": {
        "enabled": True, "command": ["huggingface-cli", "download", "Qwen/Qwen3-8B",
                                     "--local-dir", "/models/Qwen3-8B"]}},
    "security": {"mtls": {"enabled": True, "secretName": "certs"},
                 "internalToken": {"existingSecret": "my-token"}},
    "networkPolicy": {"gatewayFrom": [{"namespaceSelector": {"matchLabels": {"ingress": "yes"}}}]},
    "gateway": {"apiKeysSecret": "keys"},
    "imagePullSecrets": [{"name": "regcred"}],
    "image": {"registry": "registry.example.com", "tag": "0.1.0-rc1"},
    "nodeSelector": {"pool": "inference"},
    "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
}


@pytest.mark.parametrize("k8s_version", ["1.29.0", "1.34.0"])
@pytest.mark.parametrize("values_file", [*VALUES_FILES, "everything-on"])
def test_chart_manifests_are_valid_kubernetes(k8s_version: str, values_file: str | None) -> None:
    """Strict schema validation (unknown fields fail) of every built-in kind; the ServiceMonitor
    (a CRD) is checked by test_service_monitors_cover_every_tier."""
    kv = pytest.importorskip("kubernetes_validate")
    if values_file == "everything-on":
        values = EVERYTHING_ON
    else:
        values = {**values_of(values_file), "serviceMonitor": {"enabled": True}}
    kinds: dict[str, int] = {}
    for doc in docs_of(values):
        kinds[doc["kind"]] = kinds.get(doc["kind"], 0) + 1
        if doc["kind"] != "ServiceMonitor":
            kv.validate(doc, k8s_version, strict=True)
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "NetworkPolicy", "Pod", "ServiceMonitor"} <= set(kinds)
    if values_file == "everything-on":
        assert kinds["HorizontalPodAutoscaler"] == 3 and "Secret" not in kinds
        engine = pod_templates(docs_of(values))["engine"]
        assert engine["initContainers"][0]["command"][0] == "huggingface-cli"
        assert engine["imagePullSecrets"] == [{"name": "regcred"}]
        assert engine["runtimeClassName"] == "nvidia"
        assert engine["containers"][0]["image"] == "registry.example.com/minisgl/scheduler:0.1.0-rc1"


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_probes_reach_ports_the_container_listens_on(values_file: str | None) -> None:
    """The kubelet probes the pod IP: a network probe's port must be one the same container
    listens on pod-wide (0.0.0.0, or the metrics server); exec probes run inside it."""
    problems = []
    for component, spec in pod_templates(docs_of(values_of(values_file))).items():
        for container in spec["containers"]:
            ports = chart_checks.pod_wide_ports(container)
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                if kind not in container:
                    continue
                port = chart_checks.probe_port(container[kind], container)
                if port is not None and port not in ports:
                    problems.append(f"{component}/{container['name']} {kind} probes :{port}, "
                                    f"listens pod-wide on {sorted(ports)}")
            if component != "test" and not {"startupProbe", "readinessProbe"} <= set(container):
                problems.append(f"{component}/{container['name']} lacks a startup or readiness "
                                "probe")
    assert not problems, "\n".join(problems)


def test_mtls_turns_grpc_probes_into_exec_probes() -> None:
    docs = docs_of({"security": {"mtls": {"enabled": True, "secretName": "certs"}}})
    for component, spec in pod_templates(docs).items():
        for container in spec["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            if component != "test":
                assert env["MINISGL_INTERNAL_TLS_DIR"] == "/etc/minisgl/tls"
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = container.get(kind, {})
                assert "grpc" not in probe, (component, kind)
                if "exec" in probe:
                    assert probe["exec"]["command"][:4] == [
                        "python", "-m", "minisgl_core.healthcheck", "grpc"]


INTERNAL_CONTAINERS = ("tokenizer", "detokenizer", "scheduler", "worker")


def _internal_envs(docs: list[dict]) -> list[dict[str, str | None]]:
    return [{e["name"]: e.get("value") for e in container.get("env", [])}
            for spec in pod_templates(docs).values() for container in spec["containers"]
            if container["name"] in INTERNAL_CONTAINERS]


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_internal_services_start_with_a_token(values_file: str | None) -> None:
    """An internal service on the pod network without a token or mTLS refuses to start
    (--insecure aside): every values file gives each one the token, and none --insecure."""
    envs = _internal_envs(docs_of(values_of(values_file)))
    assert len(envs) >= len(INTERNAL_CONTAINERS)
    for env in envs:
        assert env.get("MINISGL_INTERNAL_TOKEN_FILE"), env
        assert not [k for k in env if k.endswith("_INSECURE")], env


def test_internal_auth_off_needs_security_insecure() -> None:
    """Token and mTLS both off: the chart refuses to render unless security.insecure says the pod
    network is trusted, and then passes --insecure to each internal service by its variable."""
    helm = pytest.importorskip("helm_python")
    off: dict = {"security": {"internalToken": {"enabled": False}}}
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(Exception, match="insecure"):
        chart.render(off, name="t", namespace="default")
    off["security"]["insecure"] = True
    for env in _internal_envs(docs_of(off)):
        assert "MINISGL_INTERNAL_TOKEN_FILE" not in env
        assert all(env[f"MINISGL_{s.upper()}_INSECURE"] == "1" for s in INTERNAL_CONTAINERS)


def test_compose_internal_services_have_the_token() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        if name.startswith(INTERNAL_CONTAINERS):  # worker-cuda, scheduler-2, ...
            env = service.get("environment") or {}
            assert env.get("MINISGL_INTERNAL_TOKEN_FILE"), name
            assert not [k for k in env if k.endswith("_INSECURE")], name
            assert "--insecure" not in (service.get("command") or []), name


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_grace_periods_outlast_preStop_and_drain(values_file: str | None) -> None:
    """SIGKILL never cuts a drain short, and upstreams outlive what drains through them: the
    detokenizer and scheduler finish after the gateway, the worker after its scheduler."""
    budgets, waits = {}, {}
    for component, spec in pod_templates(docs_of(values_of(values_file))).items():
        if component == "test":
            continue
        grace = spec["terminationGracePeriodSeconds"]
        for container in spec["containers"]:
            budget = chart_checks.shutdown_budget(container)
            budgets[container["name"]] = budget
            waits[container["name"]] = chart_checks.prestop_seconds(container)
            assert grace > budget, f"{component}/{container['name']}: {grace} <= {budget}"
    assert budgets["detokenizer"] >= budgets["gateway"]
    assert budgets["scheduler"] >= budgets["gateway"]
    assert waits["worker"] >= budgets["scheduler"], (waits, budgets)


def test_every_container_is_locked_down_and_sized() -> None:
    docs = docs_of({})
    secret = next(d for d in docs if d["kind"] == "Secret")
    template = (CHART / "templates" / "secret.yaml").read_text()
    assert "lookup" in template, "the internal token must survive upgrades"
    assert set(secret["data"]) == {"token"}
    for component, spec in pod_templates(docs).items():
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        for container in spec["containers"] + spec.get("initContainers", []):
            ctx = container["securityContext"]
            assert ctx["runAsUser"] == 10001 and ctx["allowPrivilegeEscalation"] is False
            assert ctx["readOnlyRootFilesystem"] is True and ctx["capabilities"]["drop"] == ["ALL"]
            assert container["resources"]["requests"] and container["resources"]["limits"]
            if component == "test":
                continue
            env = {e["name"]: e.get("value") for e in container["env"]}
            token_file = env["MINISGL_INTERNAL_TOKEN_FILE"]
            mount = next(m for m in container["volumeMounts"]
                         if token_file.startswith(m["mountPath"] + "/"))
            assert mount.get("readOnly") is True
            volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
            assert volume["secret"]["secretName"] == secret["metadata"]["name"]
            writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
            assert "/tmp" in writable and env["HOME"] == "/tmp"


def test_network_policies_admit_only_the_callers() -> None:
    docs = docs_of({})
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    labels = {component: pod_labels for component, (_, pod_labels) in pods_of(docs).items()}
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    client = {"app": "some-client"}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    sched, worker = values["engine"]["scheduler"], values["engine"]["worker"]
    ok = chart_checks.allowed
    for tier, port in (("tokenizer", values["tokenizer"]["port"]),
                       ("detokenizer", values["detokenizer"]["port"]), ("engine", sched["port"])):
        assert ok(policies, labels["gateway"], labels[tier], port), tier
        for other in ("tokenizer", "detokenizer", "engine", "test"):
            assert not ok(policies, labels[other], labels[tier], port), (other, tier)
        assert not ok(policies, client, labels[tier], port), tier
    for src in [*labels.values(), client, prometheus]:  # the worker: loopback only
        assert not ok(policies, src, labels["engine"], worker["port"])
    for tier, port in (("tokenizer", values["tokenizer"]["metricsPort"]),
                       ("detokenizer", values["detokenizer"]["metricsPort"]),
                       ("engine", sched["metricsPort"]), ("engine", worker["metricsPort"]),
                       ("gateway", values["gateway"]["httpPort"])):
        assert ok(policies, prometheus, labels[tier], port), (tier, port)
    assert ok(policies, client, labels["gateway"], values["gateway"]["httpPort"])
    assert ok(policies, labels["test"], labels["gateway"], values["gateway"]["httpPort"])


def test_service_monitors_cover_every_tier() -> None:
    docs = docs_of({"serviceMonitor": {"enabled": True}})
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    services = [d for d in docs if d["kind"] == "Service"]
    pods = pod_templates(docs)
    scraped = set()
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        selector = monitor["spec"]["selector"]["matchLabels"]
        [service] = [s for s in services
                     if all(s["metadata"]["labels"].get(k) == v for k, v in selector.items())]
        component = selector["app.kubernetes.io/component"]
        for endpoint in monitor["spec"]["endpoints"]:
            port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
            container, number = next(
                (c, cp["containerPort"]) for c in pods[component]["containers"]
                for cp in c["ports"] if port["targetPort"] in (cp["name"], cp["containerPort"]))
            assert number in chart_checks.pod_wide_ports(container)
            scraped.add(container["name"])
    assert scraped == {"gateway", "tokenizer", "detokenizer", "scheduler", "worker"}


def test_values_schema_rejects_bad_values() -> None:
    helm = pytest.importorskip("helm_python")
    for bad in ({"engine": {"worker": {"tensorParallel": 3}}},
                {"image": {"pullPolicy": "Sometimes"}},
                {"security": {"mtls": {"enabled": True}}}):
        with helm.Chart.load(str(CHART)) as chart, pytest.raises(Exception, match="schema"):
            chart.render(bad, name="t", namespace="default")


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

