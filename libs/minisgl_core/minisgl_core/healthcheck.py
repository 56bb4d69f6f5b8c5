"""One probe command for every image and pod: exit 0 when the service answers healthy, 1 otherwise.

    python -m minisgl_core.healthcheck grpc 127.0.0.1:50063 [--service minisgl.v1.Scheduler]
    python -m minisgl_core.healthcheck http http://127.0.0.1:8000/ready

Docker's HEALTHCHECK and Kubernetes exec probes run it inside the container, so it reaches the
service on loopback whatever interface the service binds. It needs only what minisgl_core needs
(grpcio and the standard library): the CPU images without torch can run it.

With MINISGL_INTERNAL_TLS_DIR set (internal mTLS on), the gRPC probe presents that directory's
client certificate; health itself needs no token. The gateway's public gRPC port is not an internal
listener: probe it with `--plaintext` (or `http .../ready`) even where that variable is set.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minisgl_core.security import TLS_DIR_ENV, InternalSecurity, SecurityConfigError


def grpc_healthy(target: str, service: str = "", timeout: float = 2.0,
                 tls_dir: str = "") -> tuple[bool, str]:
    try:
        security = InternalSecurity.load(tls_dir=tls_dir)
    except SecurityConfigError as exc:
        return False, str(exc)
    with security.sync_channel(target, []) as channel:
        try:
            # The grpc_health stubs declare HealthStub without its methods.
            reply = health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def http_healthy(url: str, timeout: float = 2.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:  # noqa: S310 - operator's URL
            return 200 <= reply.status < 300, f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except OSError as exc:
        return False, str(exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minisgl_core.healthcheck",
                                     description="exit 0 if the service is healthy")
    parser.add_argument("kind", choices=["grpc", "http"])
    parser.add_argument("target", help="HOST:PORT for grpc, a URL for http")
    parser.add_argument("--service", default="", help="gRPC health service name ('' = server)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds")
    parser.add_argument("--tls-dir", default=os.environ.get(TLS_DIR_ENV, ""),
                        help=f"internal mTLS: present this dir's client certificate (env "
                             f"{TLS_DIR_ENV})")
    parser.add_argument("--plaintext", action="store_true",
                        help="ignore --tls-dir / the env (the gateway's public gRPC port)")
    args = parser.parse_args(argv)
    if args.plaintext:
        args.tls_dir = ""
    if args.kind == "grpc":
        ok, detail = grpc_healthy(args.target, args.service, args.timeout, args.tls_dir)
    else:
        ok, detail = http_healthy(args.target, args.timeout)
    print(f"{args.target}: {detail}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
