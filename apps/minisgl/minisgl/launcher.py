"""Start the five services as separate processes on loopback, wait until all are healthy, stop them.

The same code serves `minisgl serve` and the end-to-end tests. Each child gets PR_SET_PDEATHSIG so that
no service outlives the launcher, even when the launcher itself is killed with SIGKILL.

Internal RPCs carry a random per-run token by default (written to a 0600 temp file every child
reads through MINISGL_INTERNAL_TOKEN_FILE), so other users of the host cannot drive the
internal services on loopback. `internal_tls_dir` (scripts/gen_internal_certs.py's OUTDIR) adds
mTLS: each service gets its own OUTDIR/<service> through MINISGL_INTERNAL_TLS_DIR.

Ports: the public ones (HTTP, gRPC) are fixed and checked before anything starts; the internal
ones are free ports chosen per run unless pinned (StackConfig.internal_ports, else
MINISGL_<SERVICE>_PORT), so two stacks on one host never meet. A pinned port that is taken fails
at once, and a health answer on a service's port counts only if that service's own process
listens there.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from minisgl_core.config import DEFAULT_PORTS, env_default, env_name
from minisgl_core.logging import log_fields
from minisgl_core.ports import PortInUse, free_port, in_use
from minisgl_core.security import TLS_DIR_ENV, TOKEN_FILE_ENV, InternalSecurity
from minisgl_core.serving import wait_for_health

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
def _die_with_parent() -> None:
    # Not Linux: no prctl; the launcher's own signal handling still stops the children.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _listening_ports(pid: int) -> set[int] | None:
    """TCP ports process `pid` listens on (Linux /proc; None where it cannot be read)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    inodes = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


@dataclass
class StackConfig:
    model_path: str
    host: str = "127.0.0.1"  # where the public HTTP and gRPC listeners bind
    http_port: int = DEFAULT_PORTS["gateway_http"]
    grpc_port: int = DEFAULT_PORTS["gateway_grpc"]
    # service -> a pinned port; a service not named (or 0) gets MINISGL_<SERVICE>_PORT if set,
    # else a free port: the services are wired to each other by the launcher, so fixed internal
    # ports would only let a second stack on this host reach the first one's services.
    internal_ports: dict[str, int] = field(default_factory=dict)
    # service -> more flags, after the launcher's own (`minisgl serve` routes the flags it is given
    # directly to the services declaring them: minisgl.flags)
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None  # None: children write to this process's stderr
    log_level: str = "info"
    log_format: str = "auto"  # text | json | auto (text when the service's stderr is a terminal)
    metrics: bool = True
    startup_timeout: float = 180.0
    # Gateway processes sharing the public ports (SO_REUSEPORT): one Python event loop carries
    # roughly 10k streamed tokens/s, so a fast GPU needs several. Each has its own upstream
    # streams; the kernel spreads client connections over them.
    gateway_replicas: int = 1
    # Engines (a scheduler and its worker each) behind the gateways, which route over all of them
    # (--scheduler gets the list). Engine 0 is "worker"/"scheduler", engine i "worker-i"/...
    engine_replicas: int = 1
    engine_env: dict[int, dict[str, str]] = field(default_factory=dict)  # engine -> more env
    internal_token: bool = True  # a random token on every internal RPC (off: open internals)
    internal_tls_dir: str = ""  # gen_internal_certs.py OUTDIR: mTLS between the services


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        # Internal ports: pinned by config, else by MINISGL_<SERVICE>_PORT, else free ones.
        self.pinned: dict[str, str] = {}  # service -> where its port was pinned, for errors
        self.ports: dict[str, int] = {}
        for name in ("worker", "tokenizer", "detokenizer", "scheduler"):
            port = config.internal_ports.get(name, 0)
            if port:
                self.pinned[name] = f"StackConfig.internal_ports[{name!r}]"
            else:
                port = env_default(name, "port", 0, int)
                if port:
                    self.pinned[name] = env_name(name, "port")
            self.ports[name] = port or free_port()
        for i in range(1, max(1, config.engine_replicas)):
            for name in ("worker", "scheduler"):
                self.ports[f"{name}-{i}"] = free_port()
        self.metrics_ports = {k: (free_port() if config.metrics else 0) for k in self.ports}
        self.engines = max(1, config.engine_replicas)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self._spawned_at: dict[str, float] = {}
        self.token_file: Path | None = None
        # The launcher's own health checks present a client certificate when mTLS is on.
        self.security = InternalSecurity.load(
            tls_dir=str(Path(config.internal_tls_dir) / "gateway") if config.internal_tls_dir
            else "")

    def _make_token_file(self) -> None:
        if not self.config.internal_token or self.token_file is not None:
            return
        fd, path = tempfile.mkstemp(prefix="minisgl-token-")  # mode 0600, this user only
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        self.token_file = Path(path)

    def _check_ports(self) -> None:
        """Fail before any process starts when a fixed or pinned port is taken (often by
        another stack): otherwise the health checks would reach that stack's services."""
        cfg = self.config
        for port, what, hint in ((cfg.http_port, "the HTTP port", "--port"),
                                 (cfg.grpc_port, "the gRPC port", "--grpc-port")):
            if in_use(cfg.host, port):
                raise PortInUse(f"port {port} ({what}) is in use, maybe by another minisgl "
                                f"serve: stop that process or pass another {hint}")
        for name, where in self.pinned.items():
            if in_use("127.0.0.1", self.ports[name]):
                raise PortInUse(f"port {self.ports[name]} ({name}, pinned by {where}) is in use: "
                                f"pin another port there, or unset it and the launcher picks "
                                f"a free one")

    def _security_env(self, name: str) -> dict[str, str]:
        env = {}
        if self.token_file is not None:
            env[TOKEN_FILE_ENV] = str(self.token_file)
        if self.config.internal_tls_dir:
            env[TLS_DIR_ENV] = str(Path(self.config.internal_tls_dir) / name)
        return env

    @property
    def http_url(self) -> str:
        return f"http://{self._client_host()}:{self.config.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{self._client_host()}:{self.config.grpc_port}"

    def target(self, service: str) -> str:
        return f"127.0.0.1:{self.ports[service]}"

    @staticmethod
    def engine_key(name: str, engine: int) -> str:
        return name if engine == 0 else f"{name}-{engine}"

    @property
    def scheduler_targets(self) -> list[str]:
        return [self.target(self.engine_key("scheduler", i)) for i in range(self.engines)]

    def _client_host(self) -> str:
        return "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "") else self.config.host

    def _command(self, name: str, key: str | None = None) -> list[str]:
        cfg, py = self.config, [sys.executable, "-m"]
        key = key or name
        # "-i" for engine i's worker and scheduler (gateway replicas are numbered apart)
        suffix = key.removeprefix(name) if name in ("worker", "scheduler") else ""
        common = ["--log-level", cfg.log_level, "--log-format", cfg.log_format]
        if name != "gateway":
            common += ["--host", "127.0.0.1", "--port", str(self.ports[key]),
                       "--metrics-port", str(self.metrics_ports[key])]
        commands = {
            "worker": py + ["minisgl_worker", "--model", cfg.model_path],
            "tokenizer": py + ["minisgl_tokenizer", "tokenizer", "--model", cfg.model_path],
            "detokenizer": py + ["minisgl_tokenizer", "detokenizer", "--model", cfg.model_path],
            "scheduler": py + ["minisgl_scheduler", "--worker", self.target("worker" + suffix)],
            "gateway": py + [
                "minisgl_gateway", "--host", cfg.host, "--port", str(cfg.http_port),
                "--grpc-port", str(cfg.grpc_port), "--tokenizer", self.target("tokenizer"),
                "--detokenizer", self.target("detokenizer"),
                "--scheduler", ",".join(self.scheduler_targets),
            ],
        }
        if name == "gateway" and cfg.gateway_replicas > 1:
            common.append("--reuse-port")
        return commands[name] + common + cfg.extra_args.get(name, [])

    def _spawn(self, name: str, key: str | None = None) -> None:
        out: int | IO[bytes] | None = None
        if self.config.log_dir is not None:
            self.config.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.config.log_dir / f"{key or name}.log", "wb")  # noqa: SIM115 - closed in stop()
            self._logs.append(out)
        env = {**os.environ, **self._security_env(name), **self.config.env,
               "PYTHONUNBUFFERED": "1"}
        self._spawned_at[key or name] = time.monotonic()
        if name in ("worker", "scheduler"):
            suffix = (key or name).removeprefix(name)
            env.update(self.config.engine_env.get(int(suffix[1:]) if suffix else 0, {}))
        self.processes[key or name] = subprocess.Popen(
            self._command(name, key), stdout=out, stderr=subprocess.STDOUT if out else None, env=env,
            preexec_fn=_die_with_parent, start_new_session=True,
        )

    def _wait(self, name: str, target: str, deadline: float) -> None:
        self._wait_healthy(name, target, deadline)
        # `minisgl serve` shows each service as it comes up, with the time since its start.
        took = time.monotonic() - self._spawned_at.get(name, time.monotonic())
        log.info("%s ready in %.1fs", name, took, extra=log_fields(ready=name, seconds=round(took, 2)))

    def _wait_healthy(self, name: str, target: str, deadline: float) -> None:
        while True:
            proc = self.processes[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up"
                                   + self._log_hint(name))
            try:
                wait_for_health(target, timeout=min(2.0, max(0.1, deadline - time.monotonic())),
                                security=self.security if name != "gateway" else None)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} not healthy in time" + self._log_hint(name)) from None
                continue
            port = int(target.rsplit(":", 1)[1])
            listening = _listening_ports(proc.pid)
            if listening is None or port in listening:
                return
            # Healthy, but not our process: something else took the port meanwhile.
            raise PortInUse(f"port {port} ({name}) answers from another process: stop that "
                            f"process or pin another port")

    def _wait_listening(self, key: str, deadline: float) -> None:
        """Until gateway replica `key` listens on both public ports and the shared port answers
        /ready on many fresh connections in a row (a gateway listens before its upstream streams
        are open; the kernel spreads connections over the replicas, so a replica not yet ready
        would sooner or later answer one of them with 503)."""
        ports = {self.config.http_port, self.config.grpc_port}
        proc = self.processes[key]
        ready_in_a_row = 0
        while ready_in_a_row < 16:
            if proc.poll() is not None:
                raise RuntimeError(f"{key} exited with code {proc.returncode} during start-up"
                                   + self._log_hint(key))
            if time.monotonic() > deadline:
                raise TimeoutError(f"{key} not ready in time" + self._log_hint(key))
            if (_listening_ports(proc.pid) or set()) & ports == ports and self._ready_once():
                ready_in_a_row += 1
                continue
            ready_in_a_row = 0
            time.sleep(0.1)

    def _ready_once(self) -> bool:
        try:
            with urllib.request.urlopen(self.http_url + "/ready", timeout=5) as reply:
                return reply.status == 200
        except OSError:  # HTTPError (503) included
            return False

    def _log_hint(self, name: str) -> str:
        if self.config.log_dir is None:
            return ""
        path = self.config.log_dir / f"{name}.log"
        tail = path.read_text(errors="replace")[-3000:] if path.exists() else ""
        return f"\n--- {path} (tail) ---\n{tail}"

    def start(self) -> Stack:
        deadline = time.monotonic() + self.config.startup_timeout
        try:
            self._check_ports()
            self._make_token_file()
            workers = [self.engine_key("worker", i) for i in range(self.engines)]
            for key in [*workers, "tokenizer", "detokenizer"]:
                self._spawn(key.split("-")[0], key)
            for key in [*workers, "tokenizer", "detokenizer"]:
                self._wait(key, self.target(key), deadline)
            schedulers = [self.engine_key("scheduler", i) for i in range(self.engines)]
            for key in schedulers:
                self._spawn("scheduler", key)
            for key in schedulers:
                self._wait(key, self.target(key), deadline)
            self._spawn("gateway")
            self._wait("gateway", self.grpc_target, deadline)
            replicas = [f"gateway-{i}" for i in range(1, self.config.gateway_replicas)]
            for key in replicas:
                self._spawn("gateway", key)
            for key in replicas:  # a health check through the shared port may reach any one
                self._wait_listening(key, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def add_engine(self) -> str:
        """Start one more engine (worker + scheduler) while the stack runs; returns the
        scheduler's address. The gateways use it once their discovery lists it (a `file://` or
        `dns:///` --scheduler); a static list does not change."""
        i = self.engines
        for name in ("worker", "scheduler"):
            key = self.engine_key(name, i)
            self.ports[key] = free_port()
            self.metrics_ports[key] = free_port() if self.config.metrics else 0
        deadline = time.monotonic() + self.config.startup_timeout
        for name in ("worker", "scheduler"):
            key = self.engine_key(name, i)
            self._spawn(name, key)
            self._wait(key, self.target(key), deadline)
        self.engines += 1
        return self.target(self.engine_key("scheduler", i))

    def stop(self, timeout: float = 20.0) -> dict[str, int | None]:
        """SIGTERM in reverse start order, then SIGKILL what did not exit; returns exit codes."""
        codes: dict[str, int | None] = {}
        for name in reversed(list(self.processes)):  # gateway replicas first, worker last
            proc = self.processes[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                codes[name] = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing it", name, timeout)
                proc.kill()
                codes[name] = proc.wait()
        for f in self._logs:
            f.close()
        self._logs.clear()
        self.processes.clear()
        if self.token_file is not None:
            self.token_file.unlink(missing_ok=True)
            self.token_file = None
        return codes

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_stack(model_path: str, **kwargs: Any) -> Stack:
    return Stack(StackConfig(model_path=model_path, **kwargs)).start()
