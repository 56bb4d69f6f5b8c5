"""Free loopback ports, for the launcher, TP rendezvous and the tests: one definition."""

from __future__ import annotations

import socket
import threading

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
