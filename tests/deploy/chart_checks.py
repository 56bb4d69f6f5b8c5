"""Facts about rendered chart manifests that the static tests check (test_deploy_configs.py):
which ports a container listens on pod-wide, how long its shutdown may take, and whom the
NetworkPolicies let through."""

from __future__ import annotations

import re
from typing import Any

from minisgl_core.config import flag_value as flag

from .kubesim.runtime import image_entrypoints, image_target

# A service that is not told --host listens on loopback only (minisgl_core.config).
DEFAULT_HOST = "127.0.0.1"
# After its drain the worker leaves its TP group, bounded at 30 s (docs/operations.md).
TP_TEARDOWN_S = 30


def argv(container: dict[str, Any]) -> list[str]:
    command = container.get("command") or image_entrypoints()[image_target(container["image"])]
    return [str(a) for a in [*command, *container.get("args", [])]]


def pod_wide_ports(container: dict[str, Any]) -> set[int]:
    """Ports the container's process accepts connections on at the pod IP."""
    args = argv(container)
    ports: set[int] = set()
    if (flag(args, "--host") or DEFAULT_HOST) in ("0.0.0.0", "::"):
        ports |= {int(v) for f in ("--port", "--grpc-port") if (v := flag(args, f))}
    metrics = flag(args, "--metrics-port")
    if metrics and int(metrics):  # the metrics server always binds 0.0.0.0
        ports.add(int(metrics))
    return ports


def probe_port(probe: dict[str, Any], container: dict[str, Any]) -> int | None:
    """The port a network probe targets; None for an exec probe."""
    for kind in ("grpc", "httpGet", "tcpSocket"):
        if kind in probe:
            port = probe[kind]["port"]
            if isinstance(port, str):
                port = next(p["containerPort"] for p in container["ports"] if p["name"] == port)
            return int(port)
    assert "exec" in probe, probe
    return None


def prestop_seconds(container: dict[str, Any]) -> float:
    """The longest the preStop hook runs: a sleep, or the worker's bounded wait for the
    scheduler to exit."""
    hook = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    text = " ".join(hook)
    if m := re.search(r"deadline = time\.monotonic\(\) \+ (\d+)", text) or re.fullmatch(
            r"python -c import time; time\.sleep\((\d+(?:\.\d+)?)\)", text):
        return float(m.group(1))
    assert not hook, f"cannot tell how long preStop {hook} takes"
    return 0.0


def shutdown_budget(container: dict[str, Any]) -> float:
    """Seconds from the start of termination until the container has surely exited: its preStop
    hook plus its drain timeout (plus the TP teardown for the worker)."""
    pre = prestop_seconds(container)
    args = argv(container)
    drain = float(flag(args, "--drain-timeout") or 30.0)
    return pre + drain + (TP_TEARDOWN_S if flag(args, "--tp-size") is not None else 0)


# --- NetworkPolicy ---------------------------------------------------------------------------


def _selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    if selector is None:
        return True
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer_matches(peer: dict[str, Any], labels: dict[str, str]) -> bool:
    """Pods are told apart by labels only: a peer with a namespaceSelector is taken to select
    the namespace the pod runs in (Prometheus' pod stands for its own namespace)."""
    return "ipBlock" not in peer and _selects(peer.get("podSelector"), labels)


def _rule_allows(rule: dict[str, Any], peer_key: str, labels: dict[str, str], port: int) -> bool:
    ports = rule.get("ports")
    if ports and not any(p.get("port") in (port, None) and p.get("protocol", "TCP") == "TCP"
                         for p in ports):
        return False
    peers = rule.get(peer_key)
    return not peers or any(_peer_matches(p, labels) for p in peers)


def allowed(policies: list[dict[str, Any]], src: dict[str, str], dst: dict[str, str],
            port: int) -> bool:
    """Whether TCP from a pod labelled `src` to `dst`:`port` passes both the egress policies that
    select src and the ingress policies that select dst (unselected: allowed)."""
    def direction(kind: str, pod: dict[str, str], peer: dict[str, str], key: str) -> bool:
        selecting = [p["spec"] for p in policies if _selects(p["spec"]["podSelector"], pod)
                     and kind in p["spec"].get("policyTypes", ["Ingress"])]
        return not selecting or any(
            _rule_allows(rule, key, peer, port)
            for spec in selecting for rule in spec.get(kind.lower(), []))

    return direction("Egress", src, dst, "to") and direction("Ingress", dst, src, "from")
