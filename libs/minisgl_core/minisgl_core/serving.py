"""Hosting a gRPC service: health, reflection, metrics, and a graceful drain on SIGTERM.

Every internal service is a thin adapter over a plain class; `ServiceHost` is the piece they share:

    host = ServiceHost("scheduler", args.host, args.port, metrics_port=args.metrics_port)
    host.add(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer, "minisgl.v1.Scheduler")
    host.on_drain(servicer.drain)   # optional: finish in-flight work before the server stops
    host.serve_forever(drain_timeout=args.drain_timeout)

On SIGTERM/SIGINT health turns NOT_SERVING (load balancers stop routing), the drain hooks run (bounded
by the drain timeout), the server stops with that grace, and the process exits 0.

With internal security on (`minisgl_core.security`), every RPC but health needs the shared token,
and mTLS is required when a TLS directory is given. Reflection is off unless asked for (then
behind the token too). /metrics binds where gRPC binds unless `metrics_host` says otherwise.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from minisgl_core.gc_pause import freeze_startup_objects, thaw
from minisgl_core.grpc_metrics import MetricsInterceptor
from minisgl_core.metrics import start_metrics_server
from minisgl_core.reconnect import RECONNECT_OPTIONS
from minisgl_core.security import InternalSecurity, get_default, open_warning

log = logging.getLogger(__name__)

# Largest message a client sends or accepts. Servers accept what their contract needs:
# `message_limit(context)`, so a 50 MB message is refused at the transport, before any work.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MIN_SERVER_MESSAGE_BYTES = 16 * 1024 * 1024  # a whole gateway body (8 MiB default) with room
BYTES_PER_CONTEXT_TOKEN = 64  # a token id takes <= 5 bytes; a text token <= 64 UTF-8 bytes here
GRPC_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    *RECONNECT_OPTIONS,  # clients find a restarted service within ~1 s (minisgl_core.reconnect)
]


def server_options(max_receive_bytes: int) -> list[tuple[str, Any]]:
    """GRPC_OPTIONS with another receive limit (gRPC keeps the first of duplicate keys)."""
    return [(k, max_receive_bytes if k == "grpc.max_receive_message_length" else v)
            for k, v in GRPC_OPTIONS]


def message_limit(max_model_len: int) -> int:
    """The largest message an internal server accepts for a model with this context window: one
    full-context prompt as ids or text (a batch of a whole gateway body at least), capped."""
    return max(MIN_SERVER_MESSAGE_BYTES,
               min(MAX_MESSAGE_BYTES, BYTES_PER_CONTEXT_TOKEN * max(0, max_model_len)))


class ServiceHost:
    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        metrics_port: int | None = None,
        max_workers: int = 64,
        security: InternalSecurity | None = None,
        metrics_host: str | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        reflection: bool = False,
    ) -> None:
        self.name = name
        self.address = f"{host}:{port}"
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host or host
        self.security = security if security is not None else get_default()
        limit = min(max_message_bytes, MAX_MESSAGE_BYTES)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name),
            options=server_options(limit),
            # Metrics outermost, so calls the token check refuses are counted too.
            interceptors=[*([MetricsInterceptor()] if metrics_port else []),
                          *self.security.server_interceptors()],
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # Reflection lists every method: a debugging aid, an attacker's map otherwise, so only
        # on request (--reflection); the token check covers it like any other RPC.
        self._reflection = reflection
        self._service_names: list[str] = [health.SERVICE_NAME]
        self._drain_hooks: list[Callable[[float], None]] = []
        self._stop = threading.Event()
        self.bound_port = 0

    def add(self, add_to_server: Callable[[Any, grpc.Server], None], servicer: Any,
            service_name: str) -> None:
        add_to_server(servicer, self.server)
        self._service_names.append(service_name)

    def on_drain(self, hook: Callable[[float], None]) -> None:
        """`hook(timeout_s)` runs on shutdown before the server stops; it should return once its
        in-flight work is done or the timeout has passed."""
        self._drain_hooks.append(hook)

    def start(self, serving: bool = True) -> int:
        """Listen; health says SERVING unless `serving` is False (see `set_serving`)."""
        if self._reflection:
            reflection.enable_server_reflection([*self._service_names, reflection.SERVICE_NAME],
                                                self.server)
        _check_port_free(self.name, self.address)
        creds = self.security.server_credentials()
        if creds is not None:
            self.bound_port = self.server.add_secure_port(self.address, creds)
        else:
            self.bound_port = self.server.add_insecure_port(self.address)
        if self.bound_port == 0:
            raise RuntimeError(f"{self.name}: cannot listen on {self.address}")
        self.server.start()
        self.set_serving(serving)
        if self.metrics_port:
            start_metrics_server(self.metrics_port, self.metrics_host)
        # Everything the service built before serving lives as long as the process.
        freeze_startup_objects()
        sec = self.security
        mode = ("token" if sec.token else "") + ("+mTLS" if sec.tls else "") or "open"
        log.info("%s listening on %s (internal auth: %s; metrics %s:%s)", self.name, self.address,
                 mode.lstrip("+"), self.metrics_host, self.metrics_port)
        if not sec.enabled:
            log.warning("%s: %s", self.name, open_warning(self.address.rpartition(":")[0]))
        return self.bound_port

    def set_serving(self, serving: bool) -> None:
        """Health of every service of this host: NOT_SERVING while it waits for a dependency.
        Ignored once the drain began (health stays NOT_SERVING)."""
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ["", *self._service_names[1:]]:  # [0] is the health service itself
            self.health.set(service, status)

    def stop(self, drain_timeout: float = 30.0) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        log.info("%s draining (up to %.0fs)", self.name, drain_timeout)
        self.health.enter_graceful_shutdown()
        deadline = time.monotonic() + drain_timeout
        for hook in self._drain_hooks:
            try:
                hook(max(0.0, deadline - time.monotonic()))
            except Exception:  # a failing hook must not keep the process alive
                log.exception("drain hook failed")
        self.server.stop(grace=max(0.0, deadline - time.monotonic())).wait()
        thaw()  # so that exiting frees them (native bindings such as Triton's check for leaks)
        log.info("%s stopped", self.name)

    def serve_forever(self, drain_timeout: float = 30.0,
                      prepare: Callable[[threading.Event], bool] | None = None) -> None:
        """Start, block until SIGTERM/SIGINT, drain, return (the caller exits 0).

        `prepare(stop)` runs once the server listens, with health NOT_SERVING: it waits for what
        the service needs (the scheduler's worker) and returns True when ready (health turns
        SERVING), or False once `stop` was set by a signal. What it raises stops the host and
        propagates."""
        self.start(serving=prepare is None)
        stop_requested = threading.Event()

        def _on_signal(signum: int, _frame: object) -> None:
            log.info("%s received signal %d", self.name, signum)
            stop_requested.set()

        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
        if prepare is not None:
            try:
                if prepare(stop_requested):
                    self.set_serving(True)
            except BaseException:
                self.stop(0.0)
                raise
        while not stop_requested.wait(0.5):
            pass
        self.stop(drain_timeout)


def _check_port_free(name: str, address: str) -> None:
    """Refuse a port something already listens on, with our own message: gRPC would print its
    C-core error lines on stderr first (and shares ports held with SO_REUSEPORT)."""
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    if not port_text.isdigit() or int(port_text) == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, int(port_text)))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise RuntimeError(f"{name}: cannot listen on {address}: address already in use"
                               ) from None
        # Anything else (a host name, no IPv6): gRPC's own bind decides.


def wait_for_health(target: str, timeout: float = 60.0, service: str = "",
                    security: InternalSecurity | None = None) -> None:
    """Block until `target` reports SERVING for `service`; raise TimeoutError otherwise.
    Health needs no token; with mTLS the channel presents `security`'s certificate."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    sec = InternalSecurity() if security is None else InternalSecurity(
        ca=security.ca, cert=security.cert, key=security.key)
    with sec.sync_channel(target, []) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                # The grpc_health stubs declare HealthStub without its methods.
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)  # type: ignore[attr-defined]
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as exc:
                last_error = exc
            time.sleep(0.2)
    raise TimeoutError(f"{target} not healthy after {timeout:.0f}s: {last_error}")


def channel(target: str, security: InternalSecurity | None = None) -> grpc.Channel:
    """A client channel to an internal service: the token on every call, the client certificate
    with mTLS (`security`, else this process's default)."""
    sec = security if security is not None else get_default()
    return sec.sync_channel(target, GRPC_OPTIONS)


def aio_channel(target: str, options: list[tuple[str, Any]] | None = None,
                security: InternalSecurity | None = None) -> grpc.aio.Channel:
    """`channel` for asyncio (the gateway's upstreams)."""
    sec = security if security is not None else get_default()
    return sec.aio_channel(target, GRPC_OPTIONS if options is None else options)
