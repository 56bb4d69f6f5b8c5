"""Containers as processes: a rendered container's command, args, env and mounts, run from this
checkout's venv inside its pod's network namespace, as the user its securityContext names.

What stands in for what (nothing else is changed):
- an image is its Dockerfile target: ENTRYPOINT from deploy/docker/Dockerfile when the container
  gives no `command`, `python` is the venv's python, /models/tiny (baked into the tokenizer and
  worker images) is the checkout's models/tiny;
- a volume is a directory: Secrets and ConfigMaps materialised as files (group fsGroup, their
  defaultMode), emptyDirs empty, a PersistentVolumeClaim is the checkout's models/tiny; paths
  in args and env under a mountPath are rewritten to that directory;
- runAsUser/runAsGroup via setpriv, allowPrivilegeEscalation: false as no_new_privs,
  readOnlyRootFilesystem as a read-only root mount in the process's mount namespace with its
  writable emptyDirs mounted over it (the host's /dev/shm stays writable, as a pod's does);
- GPU worker images run on CPU (`cpu_stand_in`): --device=cpu, --attention-backend=auto, and for a
  TP size the tiny model's 4 heads / 2 KV heads cannot split, random weights of the same model
  with 8 heads (--load-format=dummy) so every rank gets whole heads.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .cluster import ClusterPlan, PodPlan

ROOT = Path(__file__).resolve().parents[3]
PYTHON = str(ROOT / ".venv" / "bin" / "python")
TINY = ROOT / "models" / "tiny"
IMAGE_PATHS = {"/models/tiny": str(TINY)}
IMAGE_ENV = {"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
             "PATH": f"{ROOT / '.venv' / 'bin'}:/usr/local/bin:/usr/bin:/bin"}


@functools.cache
def python_runs_unprivileged() -> bool:
    """Whether a non-root user can start the venv's python again from inside it, as the worker
    does for its TP ranks. A venv over an interpreter under a 0700 /root cannot (setpriv's own
    exec still works): such a worker then runs as root, everything else kept (no_new_privs, the
    container's env and mounts); every other container keeps its securityContext's user."""
    check = ["setpriv", "--reuid=10001", "--regid=10001", "--clear-groups", PYTHON, "-c",
             "import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', '']).returncode)"]
    return subprocess.run(check, capture_output=True, cwd="/").returncode == 0


def image_entrypoints(dockerfile: Path = ROOT / "deploy/docker/Dockerfile") -> dict[str, list[str]]:
    targets: dict[str, list[str]] = {}
    current = ""
    for line in dockerfile.read_text().splitlines():
        if m := re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I):
            current = m.group(1)
        elif m := re.match(r"ENTRYPOINT\s+(\[.*\])", line):
            targets[current] = json.loads(m.group(1))
    return targets


def image_target(image: str) -> str:
    return image.rsplit("/", 1)[-1].split(":", 1)[0]


def cpu_stand_in(argv: list[str], image: str) -> list[str]:
    if image_target(image) != "worker-cuda":
        return argv
    out = [a for a in argv if not a.startswith(("--attention-backend", "--device"))]
    out += ["--device=cpu", "--attention-backend=auto"]
    tp = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--tp-size=")), 1)
    config = json.loads((TINY / "config.json").read_text())
    if config["num_key_value_heads"] % tp or config["num_attention_heads"] % tp:
        heads = max(tp, 8)
        out += ["--load-format=dummy", "--hf-overrides=" + json.dumps(
            {"num_attention_heads": heads, "num_key_value_heads": heads,
             "head_dim": config["hidden_size"] // heads})]
    return out


def _rewrite(value: str, paths: dict[str, str]) -> str:
    """Rewrite a container path (or `--flag=path`) under a mount to the host directory."""
    flag, sep, rest = value.partition("=") if value.startswith("--") else ("", "", value)
    for mount, host in sorted(paths.items(), key=lambda kv: -len(kv[0])):
        if rest == mount or rest.startswith(mount.rstrip("/") + "/"):
            return flag + sep + host + rest[len(mount):]
    return value


@dataclass
class Container:
    pod: PodPlan
    spec: dict[str, Any]
    workdir: Path
    proc: subprocess.Popen | None = None
    log: TextIO | None = None
    paths: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    user: tuple[int, int] = (10001, 10001)
    fs_group: int | None = None  # a supplementary group, as the kubelet adds it
    read_only_root: bool = False
    writable: list[str] = field(default_factory=list)  # host dirs of its writable emptyDirs
    no_new_privs: bool = True

    @property
    def name(self) -> str:
        return f"{self.pod.name}/{self.spec['name']}"

    def argv(self, entrypoints: dict[str, list[str]]) -> list[str]:
        spec = self.spec
        command = spec.get("command") or entrypoints[image_target(spec["image"])]
        argv = [_rewrite(str(a), self.paths) for a in [*command, *spec.get("args", [])]]
        argv = cpu_stand_in(argv, spec["image"])
        return [PYTHON if a in ("python", "python3") else a for a in argv]

    def wrap(self, argv: list[str]) -> list[str]:
        uid, gid = self.user
        respawns = any(a.startswith("--tp-size=") and a != "--tp-size=1" for a in argv)
        if respawns and not python_runs_unprivileged():
            uid, gid = 0, 0
        groups = [f"--groups={self.fs_group}"] if self.fs_group is not None else ["--clear-groups"]
        priv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", *groups,
                *(["--no-new-privs"] if self.no_new_privs else [])]
        command = [*priv, "--", *argv]
        if self.read_only_root:
            # `ip netns exec` gave the process its own mount namespace: there the root mount
            # turns read-only (a bind remount: per mount, the host's stays as it is) after each
            # writable volume became a mount of its own.
            binds = "".join(f"mount --bind {shlex.quote(d)} {shlex.quote(d)} && "
                            for d in self.writable)
            script = (f"mount --make-rslave / && {binds}mount -o remount,bind,ro / && "
                      'exec "$0" "$@"')
            command = ["sh", "-c", script, *command]
        return ["ip", "netns", "exec", self.pod.netns, *command]

    def start(self, entrypoints: dict[str, list[str]]) -> None:
        self.log = open(self.workdir / f"{self.spec['name']}.log", "a")  # noqa: SIM115
        argv = self.argv(entrypoints)
        self.log.write(f"$ {shlex.join(argv)}\n")
        self.log.flush()
        self.proc = subprocess.Popen(self.wrap(argv), env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT, cwd=self.paths.get("/tmp", "/"),
                                     start_new_session=True)

    def run_in_pod(self, command: list[str], timeout: float) -> subprocess.CompletedProcess:
        argv = [PYTHON if a in ("python", "python3") else _rewrite(str(a), self.paths)
                for a in command]
        return subprocess.run(self.wrap(argv), env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=self.paths.get("/tmp", "/"))

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def log_tail(self, lines: int = 15) -> str:
        path = self.workdir / f"{self.spec['name']}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _materialise(pod: PodPlan, cluster: ClusterPlan, workdir: Path) -> dict[str, str]:
    """volume name -> host directory."""
    fs_group = int(pod.spec.get("securityContext", {}).get("fsGroup", 0))
    dirs: dict[str, str] = {}
    for volume in pod.spec.get("volumes", []):
        name = volume["name"]
        path = workdir / "volumes" / name
        if "persistentVolumeClaim" in volume:
            dirs[name] = str(TINY)
            continue
        path.mkdir(parents=True, exist_ok=True)
        files: dict[str, bytes] = {}
        mode = 0o644
        if "secret" in volume:
            files = cluster.secrets[volume["secret"]["secretName"]]
            mode = int(volume["secret"].get("defaultMode", 0o644))
        elif "configMap" in volume:
            files = {k: v.encode() for k, v in
                     cluster.config_maps[volume["configMap"]["name"]].items()}
            mode = int(volume["configMap"].get("defaultMode", 0o644))
        else:  # emptyDir: writable by the pod's user
            path.chmod(0o1777)
        for key, data in files.items():
            (path / key).write_bytes(data)
            os.chown(path / key, 0, fs_group)
            (path / key).chmod(mode)
        dirs[name] = str(path)
    return dirs


def containers_of(pod: PodPlan, cluster: ClusterPlan, workdir: Path,
                  kinds: str = "containers") -> list[Container]:
    workdir.mkdir(parents=True, exist_ok=True)
    volumes = _materialise(pod, cluster, workdir)
    pod_ctx = pod.spec.get("securityContext", {})
    out = []
    for spec in pod.spec.get(kinds, []):
        ctx = {**pod_ctx, **spec.get("securityContext", {})}
        paths = dict(IMAGE_PATHS)
        home = workdir / f"home-{spec['name']}"
        home.mkdir(exist_ok=True)
        home.chmod(0o1777)
        paths["/home/minisgl"] = str(home)
        writable = []
        empty_dirs = {v["name"] for v in pod.spec.get("volumes", []) if "emptyDir" in v}
        for mount in spec.get("volumeMounts", []):
            host = volumes[mount["name"]]
            if mount["name"] in empty_dirs and not mount.get("readOnly") and \
                    mount["mountPath"] != "/dev/shm":
                writable.append(host)
            if mount.get("subPath") and host != str(TINY):
                host = str(Path(host) / mount["subPath"])
            if mount["mountPath"] != "/dev/shm":  # the host's own /dev/shm stands in
                paths[mount["mountPath"]] = host
        container = Container(pod, spec, workdir, paths=paths,
                              user=(int(ctx.get("runAsUser", 10001)),
                                    int(ctx.get("runAsGroup", ctx.get("runAsUser", 10001)))),
                              fs_group=pod_ctx.get("fsGroup"), writable=writable,
                              read_only_root=bool(ctx.get("readOnlyRootFilesystem")),
                              no_new_privs=not ctx.get("allowPrivilegeEscalation", True))
        env = {**IMAGE_ENV, "HOME": str(home)}
        for item in spec.get("env", []):
            env[item["name"]] = _rewrite(_env_value(item, pod, cluster), paths)
        container.env = env
        out.append(container)
    return out


def _env_value(item: dict[str, Any], pod: PodPlan, cluster: ClusterPlan) -> str:
    if "value" in item:
        return str(item["value"])
    source = item["valueFrom"]
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        return cluster.secrets[ref["name"]][ref["key"]].decode()
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return cluster.config_maps[ref["name"]][ref["key"]]
    if "fieldRef" in source:
        return {"status.podIP": pod.ip, "metadata.name": pod.name,
                "metadata.namespace": cluster.namespace}[source["fieldRef"]["fieldPath"]]
    raise ValueError(f"unsupported env source {source}")
