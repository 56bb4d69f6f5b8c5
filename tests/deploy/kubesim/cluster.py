"""From rendered manifests to the pods a cluster would run: replicas, pod IPs, Service names.

Pure data: no processes, no namespaces. `plan()` expands every Deployment/StatefulSet into its
pods (replicas, or the HPA's minReplicas when one scales it), gives each an IP of `subnet`, and
maps every Service name to the IPs of the pods its selector matches (a ClusterIP Service resolves
to its pods directly, as kube-proxy would forward to one of them; a headless one to all).
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class PodPlan:
    name: str            # e.g. t-minisgl-gateway-0
    netns: str           # network namespace it runs in
    ip: str
    labels: dict[str, str]
    spec: dict[str, Any]  # the pod template's spec
    hook: bool = False   # a `helm test` pod: runs to completion after the others are Ready


@dataclass
class ClusterPlan:
    namespace: str
    pods: list[PodPlan]
    services: dict[str, dict[str, Any]]        # name -> Service manifest
    service_ips: dict[str, list[str]]          # name -> pod IPs it resolves to
    secrets: dict[str, dict[str, bytes]]       # name -> key -> value
    config_maps: dict[str, dict[str, str]]
    service_monitors: list[dict[str, Any]] = field(default_factory=list)

    def hosts(self) -> str:
        """/etc/hosts of every pod: each Service's short and cluster-qualified name."""
        lines = ["127.0.0.1 localhost"]
        for name, ips in sorted(self.service_ips.items()):
            for ip in ips:
                lines.append(f"{ip} {name} {name}.{self.namespace} "
                             f"{name}.{self.namespace}.svc.cluster.local")
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["secrets"] = {n: {k: base64.b64encode(v).decode() for k, v in d.items()}
                           for n, d in self.secrets.items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterPlan:
        data = dict(data)
        data["pods"] = [PodPlan(**p) for p in data["pods"]]
        data["secrets"] = {n: {k: base64.b64decode(v) for k, v in d.items()}
                           for n, d in data["secrets"].items()}
        return cls(**data)


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def plan(docs: list[dict[str, Any]], namespace: str, prefix: str, subnet: str) -> ClusterPlan:
    """`subnet` like "10.244.7": pods get .2, .3, ... (.1 is the node)."""
    hpa_min = {d["spec"]["scaleTargetRef"]["name"]: d["spec"].get("minReplicas", 1)
               for d in docs if d["kind"] == "HorizontalPodAutoscaler"}
    pods: list[PodPlan] = []

    def add(name: str, labels: dict[str, str], spec: dict[str, Any], hook: bool) -> None:
        index = len(pods)
        pods.append(PodPlan(name=name, netns=f"{prefix}-p{index}", ip=f"{subnet}.{index + 2}",
                            labels=labels, spec=spec, hook=hook))

    for doc in docs:
        kind, meta = doc["kind"], doc["metadata"]
        if kind in ("Deployment", "StatefulSet"):
            template = doc["spec"]["template"]
            replicas = doc["spec"].get("replicas", hpa_min.get(meta["name"], 1))
            for i in range(replicas):
                add(f"{meta['name']}-{i}", template["metadata"]["labels"], template["spec"], False)
        elif kind == "Pod" and "test" in meta.get("annotations", {}).get("helm.sh/hook", ""):
            add(meta["name"], meta.get("labels", {}), doc["spec"], True)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    service_ips = {name: [p.ip for p in pods if not p.hook
                          and _matches(svc["spec"].get("selector", {}), p.labels)]
                   for name, svc in services.items()}
    secrets = {}
    for d in docs:
        if d["kind"] == "Secret":
            values = {k: base64.b64decode(v) for k, v in (d.get("data") or {}).items()}
            values.update({k: v.encode() for k, v in (d.get("stringData") or {}).items()})
            secrets[d["metadata"]["name"]] = values
    config_maps = {d["metadata"]["name"]: dict(d.get("data") or {})
                   for d in docs if d["kind"] == "ConfigMap"}
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    return ClusterPlan(namespace, pods, services, service_ips, secrets, config_maps, monitors)
