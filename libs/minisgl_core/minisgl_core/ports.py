"""Free loopback ports, for the launcher, TP rendezvous and the tests: one definition; and
whether a port someone chose is free before a whole stack starts around it."""

from __future__ import annotations

import errno
import socket
import threading

from minisgl_core.startup import StartupError

_GIVEN: set[int] = set()
_LOCK = threading.Lock()


def free_port() -> int:
    """A port nothing listens on now and that this process has not handed out before: two
    services of one stack must never share one (gRPC servers bind with SO_REUSEPORT, so both
    would start and split the connections between them)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        with _LOCK:
            if port not in _GIVEN:
                _GIVEN.add(port)
                return port


class PortInUse(StartupError):
    """A port given by the operator already has a listener; the message names how to move it."""


def in_use(host: str, port: int) -> bool:
    """Whether something listens on `host`:`port` now. A plain bind (no SO_REUSEPORT) fails next
    to any listener, gRPC's shared ones included; SO_REUSEADDR lets connections of a stopped
    process (TIME_WAIT) through. Other errors (an unknown host, no IPv6) are left to the real
    bind."""
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        return exc.errno == errno.EADDRINUSE
    return False
