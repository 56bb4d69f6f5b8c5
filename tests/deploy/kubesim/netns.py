"""Network namespaces for the stand-in cluster: one per pod plus one for the node, on a bridge.

Everything lives in namespaces created here: a hub namespace holds the bridge, each pod and the
node get a veth into it and one address of a private /24. Nothing is added to the host's own
network namespace, and no route leads out of the /24. `ip netns exec NS` bind-mounts
/etc/netns/NS/hosts over /etc/hosts, which is how Service names resolve inside each namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def can_create_namespaces() -> str | None:
    """None when this machine can run the cluster, else why not."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool, package in (("ip", "iproute2"), ("setpriv", "util-linux"), ("mount", "mount")):
        if shutil.which(tool) is None:
            return f"`{tool}` ({package}) is not installed"
    probe = f"msgl-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        return f"`ip netns add` failed: {exc.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Network:
    prefix: str                      # short, unique per run: names stay under 15 characters
    subnet: str                      # "10.244.7": the node is .1
    members: list[tuple[str, str]] = field(default_factory=list)  # (netns, ip)

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    @property
    def node(self) -> str:
        return f"{self.prefix}-node"

    def up(self) -> None:
        _ip("netns", "add", self.hub)
        _ip("link", "add", "br0", "type", "bridge", netns=self.hub)
        _ip("link", "set", "br0", "up", netns=self.hub)
        _ip("link", "set", "lo", "up", netns=self.hub)
        self.attach(self.node, f"{self.subnet}.1")

    def attach(self, netns: str, ip: str) -> None:
        index = len(self.members)
        outer, inner = f"{self.prefix}h{index}", f"{self.prefix}c{index}"
        _ip("netns", "add", netns)
        _ip("link", "set", "lo", "up", netns=netns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner, netns=self.hub)
        _ip("link", "set", inner, "netns", netns, netns=self.hub)
        _ip("link", "set", outer, "master", "br0", netns=self.hub)
        _ip("link", "set", outer, "up", netns=self.hub)
        _ip("link", "set", inner, "name", "eth0", netns=netns)
        _ip("addr", "add", f"{ip}/24", "dev", "eth0", netns=netns)
        _ip("link", "set", "eth0", "up", netns=netns)
        self.members.append((netns, ip))

    def write_hosts(self, hosts: str) -> None:
        for netns, _ in self.members:
            directory = Path("/etc/netns") / netns
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "hosts").write_text(hosts)

    def down(self) -> None:
        """Kill what still runs in our namespaces (by pid: only processes the run started, e.g.
        after the driver itself died), then delete them."""
        for netns, _ in self.members:
            pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for netns, _ in self.members:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)
        subprocess.run(["ip", "netns", "del", self.hub], capture_output=True)
