"""One process, one event loop: the gRPC server (grpc.aio) and uvicorn (HTTP) side by side.

Start-up: bind both listeners at once (`/health` answers: the process lives), then wait for the
upstreams as long as it takes (or --startup-timeout seconds, then exit 1): open the streams, learn
the model. Until then `/ready` answers 503 and gRPC health NOT_SERVING; afterwards both follow the
upstreams (checked every second), so a balancer routes only to a gateway that can serve.
SIGTERM/SIGINT: /ready and gRPC health turn NOT_SERVING, new requests get 503, in-flight ones
may finish for up to --drain-timeout seconds, both servers stop, the process exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from minisgl_core.gc_pause import freeze_startup_objects, thaw
from minisgl_core.proto.minisgl.v1 import generation_pb2
from minisgl_core.serving import server_options

from minisgl_gateway.api.grpc_service import GenerationService, add_to_server
from minisgl_gateway.api.http_app import asgi_app
from minisgl_gateway.api.http_limits import limited_protocol
from minisgl_gateway.config import GatewayConfig
from minisgl_gateway.gateway import Gateway

log = logging.getLogger(__name__)
# Idle keep-alive connections stay open this long (uvicorn's default is 5 s). A client that reuses
# a pooled connection just as the server closes it gets a bare connection error; under load that
# hit 1-2 of 256 streams in bench/micro/host_ceiling.py with a 5 s timeout, none in 5 runs with 75 s.
# 75 s is above the usual load-balancer idle timeout (60 s), so the balancer closes first.
KEEP_ALIVE_S = 75
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
HEALTH_INTERVAL_S = 1.0  # gRPC health follows the upstreams at this pace


def _bind_tcp(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port} (HTTP): {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway drains both servers itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayServer:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.gateway = Gateway(config)
        self.health = health.aio.HealthServicer()
        # gRPC turns SO_REUSEPORT on by default on Linux, so a second gateway on the same port
        # would start and silently share it; only replicas that ask for it may.
        # A request message is the gRPC twin of an HTTP body: the same bound (plus framing).
        lim = config.limits
        self.grpc_server = grpc.aio.server(
            options=[*server_options(lim.max_body_bytes + 64 * 1024),
                     ("grpc.so_reuseport", int(config.reuse_port))])
        add_to_server(GenerationService(self.gateway), self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], self.grpc_server)
        tls: dict[str, Any] = {}
        if config.tls_cert:
            tls = {"ssl_certfile": config.tls_cert, "ssl_keyfile": config.tls_key}
        self.http = _Uvicorn(uvicorn.Config(
            asgi_app(self.gateway), host=config.host, port=config.port, log_config=None,
            http=limited_protocol(lim.max_header_bytes, lim.max_headers, lim.header_timeout_s,
                                  lim.body_timeout_s, lim.max_body_readers, lim.retry_after_s),
            access_log=False, lifespan="off", timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=max(1, int(
                config.drain_timeout)), **tls))
        self.grpc_port = 0
        self.http_port = 0
        self._stop = asyncio.Event()
        self._http_task: asyncio.Task[None] | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._serving = False

    def _bind_grpc(self) -> int:
        address = f"{self.config.host}:{self.config.grpc_port}"
        if self.config.tls_cert:
            creds = grpc.ssl_server_credentials([(Path(self.config.tls_key).read_bytes(),
                                                  Path(self.config.tls_cert).read_bytes())])
            port = self.grpc_server.add_secure_port(address, creds)
        else:
            port = self.grpc_server.add_insecure_port(address)
        if port == 0:
            raise RuntimeError(f"cannot listen on {address} (gRPC)")
        return port

    async def start(self) -> None:
        self.grpc_port = self._bind_grpc()
        await self._set_health(False)
        await self.grpc_server.start()
        # Bound here, not by uvicorn: uvicorn answers a busy port with sys.exit(), which would
        # tear through the event loop instead of reaching the clean shutdown below.
        sock = _bind_tcp(self.config.host, self.config.port, self.config.reuse_port)
        self.http_port = sock.getsockname()[1]
        self._http_task = asyncio.create_task(self.http.serve(sockets=[sock]))
        while not self.http.started:
            if self._http_task.done():
                error = self._http_task.exception()
                self._http_task = None
                raise RuntimeError(f"HTTP server failed to start: {error!r}")
            await asyncio.sleep(0.02)
        scheme = "https" if self.config.tls_cert else "http"
        log.info("gateway listening: %s://%s:%d (OpenAI), gRPC %s:%d; waiting for upstreams",
                 scheme, self.config.host, self.http_port, self.config.host, self.grpc_port)
        await self.gateway.start()
        await self._set_health(True)
        self._health_task = asyncio.create_task(self._follow_upstreams())
        # What exists now (FastAPI, pydantic, protobuf, gRPC, the app) lives as long as the
        # process: out of the cyclic collector's generations, the collections that streaming's
        # short-lived garbage triggers no longer walk it (tests/test_gc_pause.py).
        freeze_startup_objects()
        log.info("gateway ready")

    async def _set_health(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)
        self._serving = serving

    async def _follow_upstreams(self) -> None:
        """gRPC health says what /ready says: SERVING only while every upstream is."""
        while not self.gateway.draining:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            ok = all((await self.gateway.upstream_health()).values())
            if ok != self._serving and not self.gateway.draining:
                log.warning("upstreams %s: gRPC health %s", "back" if ok else "down",
                            "SERVING" if ok else "NOT_SERVING")
                await self._set_health(ok)

    def request_stop(self) -> None:
        self._stop.set()

    async def drain(self) -> None:
        """Stop taking requests, let the admitted ones finish (bounded), stop both servers."""
        gw = self.gateway
        gw.draining = True
        if self._health_task is not None:
            self._health_task.cancel()
        await self.health.enter_graceful_shutdown()
        deadline = time.monotonic() + self.config.drain_timeout
        log.info("draining %d in-flight requests (up to %.0fs)", gw.active,
                 self.config.drain_timeout)
        while gw.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if gw.active:
            log.warning("drain timeout: %d requests still running are cut off", gw.active)
        self.http.should_exit = True
        await self.grpc_server.stop(grace=max(0.0, deadline - time.monotonic()))
        if self._http_task is not None:
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(self._http_task,
                                       timeout=max(1.0, deadline - time.monotonic()))
        await gw.close()
        thaw()
        log.info("gateway stopped")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        starting = asyncio.create_task(self.start())
        stopping = asyncio.create_task(self._stop.wait())
        try:
            # A signal while still waiting for the upstreams stops at once.
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if starting.done():
                starting.result()  # start-up errors propagate (exit 1)
                await stopping
        finally:
            for task in (starting, stopping):
                task.cancel()
            await asyncio.gather(starting, stopping, return_exceptions=True)
            await self.drain()
