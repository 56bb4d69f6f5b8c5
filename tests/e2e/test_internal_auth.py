"""Service-to-service authentication on the real five-process stack (minisgl_core.security).

One stack with the launcher's default (a random token), one with token + mTLS from
scripts/gen_internal_certs.py. Every internal service refuses calls without the token or with a
wrong one, streams included; health stays open; reflection is off; the stack still serves."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from minisgl.launcher import Stack, StackConfig
from minisgl_core.ports import free_port
from minisgl_core.security import (
    TLS_DIR_ENV,
    TLS_TARGET_NAME,
    TOKEN_FILE_ENV,
    TOKEN_HEADER,
    InternalSecurity,
)

ROOT = Path(__file__).resolve().parents[2]
# One method of each kind per internal service: (service, method path, streaming request).
METHODS = [
    ("tokenizer", "/minisgl.v1.Tokenizer/GetTokenizerInfo", False),
    ("tokenizer", "/minisgl.v1.Tokenizer/Tokenize", False),
    ("detokenizer", "/minisgl.v1.Detokenizer/Detokenize", True),
    ("scheduler", "/minisgl.v1.Scheduler/Connect", True),
    ("scheduler", "/minisgl.v1.Scheduler/GetInfo", False),
    ("worker", "/minisgl.v1.Worker/GetWorkerInfo", False),
    ("worker", "/minisgl.v1.Worker/Step", True),
]


def _call(channel: grpc.Channel, method: str, streaming: bool,
          metadata: tuple[tuple[str, str], ...] = ()) -> grpc.StatusCode:
    """The status of one raw call (empty message; the payload never matters here)."""
    try:
        if streaming:
            for _ in channel.stream_stream(method)(iter([b""]), metadata=metadata, timeout=5):
                pass
        else:
            channel.unary_unary(method)(b"", metadata=metadata, timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _start(model: Path, log_dir: Path, **kw: object) -> Stack:
    return Stack(StackConfig(
        model_path=str(model), http_port=free_port(), grpc_port=free_port(),
        internal_ports=dict.fromkeys(("worker", "tokenizer", "detokenizer", "scheduler"), 0),
        log_dir=log_dir, log_level="warning", **kw)).start()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def token_stack(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[Stack]:
    stack = _start(tiny_model_path, tmp_path_factory.mktemp("token-stack"))
    try:
        yield stack
    finally:
        token_file = stack.token_file
        assert all(code == 0 for code in stack.stop().values())
        assert token_file is not None and not token_file.exists()  # removed on stop


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_internal_certs.py"), str(out)],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def mtls_stack(tiny_model_path: Path, certs: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Stack]:
    stack = _start(tiny_model_path, tmp_path_factory.mktemp("mtls-stack"), metrics=False,
                   internal_tls_dir=str(certs))
    try:
        yield stack
    finally:
        assert all(code == 0 for code in stack.stop().values())


def _complete(stack: Stack) -> str:
    reply = httpx.post(f"{stack.http_url}/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_token_file_is_private_and_the_stack_serves_with_it(token_stack: Stack) -> None:
    assert token_stack.token_file is not None
    assert token_stack.token_file.stat().st_mode & 0o777 == 0o600
    assert _complete(token_stack)


@pytest.mark.parametrize(("service", "method", "streaming"), METHODS)
def test_internal_rpcs_need_the_token(token_stack: Stack, service: str, method: str,
                                      streaming: bool) -> None:
    token = token_stack.token_file.read_text()  # type: ignore[union-attr]
    with grpc.insecure_channel(token_stack.target(service)) as channel:
        assert _call(channel, method, streaming) == grpc.StatusCode.UNAUTHENTICATED
        wrong = ((TOKEN_HEADER, token[:-1] + ("x" if token[-1] != "x" else "y")),)
        assert _call(channel, method, streaming, wrong) == grpc.StatusCode.UNAUTHENTICATED
        if method.endswith("Info"):  # harmless with the right token: it answers
            assert _call(channel, method, streaming, ((TOKEN_HEADER, token),)) == \
                grpc.StatusCode.OK


@pytest.mark.parametrize("service", ["tokenizer", "detokenizer", "scheduler", "worker"])
def test_health_open_and_reflection_off(token_stack: Stack, service: str) -> None:
    with grpc.insecure_channel(token_stack.target(service)) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
        assert _call(channel, reflect, True) == grpc.StatusCode.UNIMPLEMENTED


def _listen_address(pid: int, port: int) -> str:
    """The IPv4 address process `pid` listens on at TCP `port` (from /proc/net)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            host, _, hex_port = cols[1].partition(":")
            if cols[3] == "0A" and cols[9] in inodes and int(hex_port, 16) == port:
                if len(host) == 32 and not host.startswith("0000000000000000FFFF0000"):
                    return host  # a real IPv6 address: never what these tests expect
                v4 = host[-8:]  # IPv4, or IPv4-mapped IPv6 (gRPC's sockets)
                return ".".join(str(int(v4[i:i + 2], 16)) for i in (6, 4, 2, 0))
    raise AssertionError(f"pid {pid} does not listen on {port}")


@pytest.mark.parametrize("service", ["tokenizer", "detokenizer", "scheduler", "worker"])
def test_metrics_bind_where_grpc_binds(token_stack: Stack, service: str) -> None:
    pid = token_stack.processes[service].pid
    assert _listen_address(pid, token_stack.metrics_ports[service]) == "127.0.0.1"
    assert _listen_address(pid, token_stack.ports[service]) == "127.0.0.1"


def test_mtls_stack_serves(mtls_stack: Stack) -> None:
    assert _complete(mtls_stack)


@pytest.mark.parametrize("service", ["tokenizer", "scheduler", "worker"])
def test_mtls_refuses_clients_without_a_certificate(mtls_stack: Stack, certs: Path,
                                                    service: str) -> None:
    target = mtls_stack.target(service)
    health = "/grpc.health.v1.Health/Check"
    with grpc.insecure_channel(target) as channel:  # plaintext: no TLS handshake at all
        assert _call(channel, health, False) == grpc.StatusCode.UNAVAILABLE
    server_only = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.crt").read_bytes())
    with grpc.secure_channel(target, server_only, options=[
            ("grpc.ssl_target_name_override", TLS_TARGET_NAME)]) as channel:
        assert _call(channel, health, False) == grpc.StatusCode.UNAVAILABLE
    # A certificate from another CA is refused as well.
    with grpc.secure_channel(target, grpc.ssl_channel_credentials(), options=[
            ("grpc.ssl_target_name_override", TLS_TARGET_NAME)]) as channel:
        assert _call(channel, health, False) == grpc.StatusCode.UNAVAILABLE
    # With the certificate, health answers and everything else still needs the token.
    sec = InternalSecurity.load(tls_dir=str(certs / "gateway"))
    with sec.sync_channel(target, []) as channel:
        assert _call(channel, health, False) == grpc.StatusCode.OK
        method, streaming = next((m, s) for n, m, s in METHODS if n == service)
        assert _call(channel, method, streaming) == grpc.StatusCode.UNAUTHENTICATED


def test_healthcheck_cli_presents_the_certificate(mtls_stack: Stack, certs: Path) -> None:
    cmd = [sys.executable, "-m", "minisgl_core.healthcheck", "grpc", mtls_stack.target("worker")]
    env = {k: v for k, v in os.environ.items() if k != TLS_DIR_ENV}
    plain = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert plain.returncode == 1, plain.stdout
    env[TLS_DIR_ENV] = str(certs / "worker")
    tls = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert tls.returncode == 0, tls.stdout + tls.stderr
    # The gateway's public port is plaintext: --plaintext ignores the internal TLS setting.
    public = [*cmd[:-1], mtls_stack.grpc_target]
    assert subprocess.run(public, env=env, capture_output=True, timeout=30).returncode == 1
    plain = subprocess.run([*public, "--plaintext"], env=env, capture_output=True, text=True,
                           timeout=30)
    assert plain.returncode == 0, plain.stdout + plain.stderr


def test_metrics_host_flag_overrides() -> None:
    """--metrics-host puts /metrics elsewhere than gRPC (here: another loopback address)."""
    from minisgl_core.serving import ServiceHost

    metrics_port = free_port()
    host = ServiceHost("probe", "127.0.0.1", 0, metrics_port=metrics_port,
                       metrics_host="127.0.0.2", security=InternalSecurity())
    host.start()
    try:
        assert _listen_address(os.getpid(), metrics_port) == "127.0.0.2"
        assert httpx.get(f"http://127.0.0.2:{metrics_port}/metrics").status_code == 200
    finally:
        host.stop(0.1)


# -- services started by hand, without a token ----------------------------------------------

INTERNAL = {  # service -> how it is started (the model, where it needs one, comes after)
    "tokenizer": (["minisgl_tokenizer", "tokenizer"], True),
    "detokenizer": (["minisgl_tokenizer", "detokenizer"], True),
    "scheduler": (["minisgl_scheduler", "--worker", "127.0.0.1:1"], False),
    "worker": (["minisgl_worker", "--device", "cpu"], True),
}


def _by_hand(service: str, model: Path, port: int, *flags: str) -> subprocess.Popen[str]:
    module, needs_model = INTERNAL[service]
    env = {k: v for k, v in os.environ.items()
           if k not in (TOKEN_FILE_ENV, TLS_DIR_ENV) and not k.endswith("_INSECURE")}
    return subprocess.Popen(
        [sys.executable, "-m", *module, *(["--model", str(model)] if needs_model else []),
         "--port", str(port), "--metrics-port", "0", "--log-format", "text", *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_open_service_on_the_network_refuses_to_start(tiny_model_path: Path) -> None:
    """Every internal service on 0.0.0.0 without a token or mTLS exits 1 before it loads
    anything, with one line naming --insecure and its variable."""
    procs = {s: _by_hand(s, tiny_model_path, free_port(), "--host", "0.0.0.0") for s in INTERNAL}
    try:
        for service, proc in procs.items():
            out, _ = proc.communicate(timeout=90)
            assert proc.returncode == 1, out
            errors = [line for line in out.splitlines() if "ERROR" in line]
            assert len(errors) == 1, out
            assert "--insecure" in errors[0] and f"MINISGL_{service.upper()}_INSECURE" in errors[0]
            assert "Traceback" not in out
    finally:
        for proc in procs.values():  # one that served instead of refusing
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("flags", [("--host", "0.0.0.0", "--insecure", "--reflection"),
                                   ("--host", "127.0.0.1")], ids=["insecure", "loopback"])
def test_open_service_starts_with_a_warning(tiny_model_path: Path, flags: tuple[str, ...]
                                            ) -> None:
    """--insecure lets it listen on every interface; on loopback it starts without the flag.
    Either way it warns, and reflection is on only where --reflection asks for it."""
    from minisgl_core.serving import wait_for_health

    port = free_port()
    proc = _by_hand("tokenizer", tiny_model_path, port, *flags)
    try:
        wait_for_health(f"127.0.0.1:{port}", timeout=60)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reflect = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
            status = _call(channel, reflect, True)
            assert (status != grpc.StatusCode.UNIMPLEMENTED) == ("--reflection" in flags)
            assert _call(channel, "/minisgl.v1.Tokenizer/GetTokenizerInfo", False) \
                == grpc.StatusCode.OK
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert any("WARNING" in line and "no internal token or mTLS" in line
               for line in out.splitlines()), out
