"""Service-to-service authentication: a shared token on every internal RPC, optional mTLS.

    security = InternalSecurity.load(token_file, tls_dir)   # or .from_env()
    server side: ServiceHost(..., security=security)         # interceptor + TLS credentials
    client side: serving.channel(target, security)           # token metadata + client cert

The token travels as gRPC metadata `x-minisgl-internal-token`; servers check it on every RPC
except the standard `grpc.health.v1.Health` service (kubelet gRPC probes cannot send metadata)
and answer UNAUTHENTICATED otherwise. With a TLS directory (`ca.crt`, `tls.crt`, `tls.key`)
servers also require a client certificate signed by that CA.

Target names: services are reached under whatever name the deployment gives them (compose service,
Kubernetes Service, 127.0.0.1), so clients do not check the certificate against the address they
dialled. Every certificate `scripts/gen_internal_certs.py` makes carries the fixed SAN
`TLS_TARGET_NAME` besides its service's own names, and clients verify that name
(`grpc.ssl_target_name_override`): the check is "signed by our CA", not "is this very service".

A process sets its security once (`set_default`); `serving.channel()` and `ServiceHost` use it
when not given one, so clients built deep inside a service (the scheduler's worker client) need
no plumbing of their own.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from minisgl_core.config import env_name
from minisgl_core.startup import StartupError

TOKEN_HEADER = "x-minisgl-internal-token"
TOKEN_FILE_ENV = "MINISGL_INTERNAL_TOKEN_FILE"
TLS_DIR_ENV = "MINISGL_INTERNAL_TLS_DIR"
TLS_TARGET_NAME = "minisgl-internal"
OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # method prefixes served without a token


class SecurityConfigError(ValueError):
    """A token file or TLS directory that cannot be used."""


@dataclass(frozen=True)
class InternalSecurity:
    token: str = ""
    ca: bytes = b""
    cert: bytes = b""
    key: bytes = b""

    @property
    def tls(self) -> bool:
        return bool(self.cert)

    @property
    def enabled(self) -> bool:
        return bool(self.token) or self.tls

    @classmethod
    def load(cls, token_file: str = "", tls_dir: str = "") -> InternalSecurity:
        token = ""
        if token_file:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as exc:
                raise SecurityConfigError(f"internal token file {token_file}: {exc}") from None
            if not token:
                raise SecurityConfigError(f"internal token file {token_file} is empty")
        ca = cert = key = b""
        if tls_dir:
            files = {}
            for name in ("ca.crt", "tls.crt", "tls.key"):
                try:
                    files[name] = (Path(tls_dir) / name).read_bytes()
                except OSError as exc:
                    raise SecurityConfigError(f"internal TLS dir {tls_dir}: {exc}") from None
            ca, cert, key = files["ca.crt"], files["tls.crt"], files["tls.key"]
        return cls(token=token, ca=ca, cert=cert, key=key)

    @classmethod
    def from_env(cls) -> InternalSecurity:
        return cls.load(os.environ.get(TOKEN_FILE_ENV, ""), os.environ.get(TLS_DIR_ENV, ""))

    # -- server side -------------------------------------------------------------------------

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def server_interceptors(self) -> list[grpc.ServerInterceptor]:
        return [TokenCheck(self.token)] if self.token else []

    # -- client side -------------------------------------------------------------------------

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_HEADER, self.token),) if self.token else ()

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", TLS_TARGET_NAME)] if self.tls else []

    def sync_channel(self, target: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        creds = self.channel_credentials()
        options = [*options, *self.channel_options()]
        ch = grpc.secure_channel(target, creds, options=options) if creds \
            else grpc.insecure_channel(target, options=options)
        if self.token:
            ch = grpc.intercept_channel(ch, _SyncToken(self.metadata()))
        return ch

    def aio_channel(self, target: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        creds = self.channel_credentials()
        options = [*options, *self.channel_options()]
        interceptors = _aio_token_interceptors(self.metadata()) if self.token else None
        if creds:
            return grpc.aio.secure_channel(target, creds, options=options,
                                           interceptors=interceptors)
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


_default: InternalSecurity | None = None


def set_default(security: InternalSecurity) -> None:
    """This process's internal security (a service's main sets it from its flags)."""
    global _default
    _default = security


def get_default() -> InternalSecurity:
    """What `set_default` set, else what the environment says."""
    global _default
    if _default is None:
        _default = InternalSecurity.from_env()
    return _default


def from_args(token_file: str, tls_dir: str) -> InternalSecurity:
    """Load from a service's flags, make it the process default, exit 2 on a bad file."""
    try:
        security = InternalSecurity.load(token_file, tls_dir)
    except SecurityConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    set_default(security)
    return security


def is_loopback(host: str) -> bool:
    """Whether only this host can reach a listener on `host` ("", 0.0.0.0 and :: are every
    interface; a name other than localhost may resolve anywhere, so it counts as reachable)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listener(service: str, host: str, security: InternalSecurity, insecure: bool) -> None:
    """Refuse to serve an internal service's RPCs to the network without a token or mTLS: an
    open scheduler generates for anyone who reaches it. `insecure` (--insecure) is the
    operator saying the network itself is trusted. On loopback an open service only warns
    (`open_warning`, once it listens): every local user can still drive it."""
    if security.enabled or insecure or is_loopback(host):
        return
    raise StartupError(
        f"{service} would serve internal RPCs on {host or '0.0.0.0'} to anyone without a token "
        f"or mTLS: set --internal-token-file (MINISGL_INTERNAL_TOKEN_FILE) or "
        f"--internal-tls-dir, or pass --insecure ({env_name(service, 'insecure')}=1) if the "
        f"network is trusted")


def open_warning(host: str) -> str:
    """What an internal service without a token or mTLS logs once it listens on `host`."""
    who = "any local user" if is_loopback(host) else "anyone who reaches the port"
    return (f"no internal token or mTLS: {who} can call every RPC (set --internal-token-file or "
            f"MINISGL_INTERNAL_TOKEN_FILE)")


# -- server interceptor ----------------------------------------------------------------------


def _deny(handler: grpc.RpcMethodHandler[Any, Any],
          message: str) -> grpc.RpcMethodHandler[Any, Any]:
    def abort(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    # Same arity as the real method, so gRPC reads the call the way the client sends it; no
    # deserializer: the request is never looked at.
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class TokenCheck(grpc.ServerInterceptor):
    """Refuses every RPC (health excepted) whose metadata lacks the shared token."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        given = ""
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_HEADER:
                given = value if isinstance(value, str) else value.decode("utf-8", "replace")
                break
        if not given:
            return _deny(handler, f"missing {TOKEN_HEADER} metadata")
        if not hmac.compare_digest(given.encode("utf-8", "replace"), self._token):
            return _deny(handler, f"wrong {TOKEN_HEADER}")
        return handler


# -- client interceptors ---------------------------------------------------------------------


def _with_token(details: Any, metadata: tuple[tuple[str, str], ...]) -> Any:
    merged = [*(details.metadata or ()), *metadata]
    return _SyncDetails(details.method, details.timeout, merged, details.credentials,
                        getattr(details, "wait_for_ready", None),
                        getattr(details, "compression", None))


@dataclass(frozen=True)
class _SyncDetails:
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _call(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(_with_token(details, self._metadata), request)

    # One body serves all four kinds; the grpc stubs type each one with its own generic signature.
    intercept_unary_unary = _call  # type: ignore[assignment]
    intercept_unary_stream = _call  # type: ignore[assignment]
    intercept_stream_unary = _call  # type: ignore[assignment]
    intercept_stream_stream = _call  # type: ignore[assignment]


def _aio_token_interceptors(metadata: tuple[tuple[str, str], ...]) -> list[Any]:
    aio = grpc.aio

    def details_with_token(details: Any) -> Any:
        return details._replace(metadata=aio.Metadata(*(details.metadata or ()), *metadata))

    class UnaryUnary(aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            return await continuation(details_with_token(details), request)

    class UnaryStream(aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
            return await continuation(details_with_token(details), request)

    class StreamUnary(aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
            return await continuation(details_with_token(details), request_iterator)

    class StreamStream(aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation: Any, details: Any,
                                          request_iterator: Any) -> Any:
            return await continuation(details_with_token(details), request_iterator)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]
