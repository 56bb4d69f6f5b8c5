"""Which engines (scheduler addresses) the gateway routes over, from `--scheduler`:

- `host:port` or `a:1,b:2`: a static list (a single name is one engine, resolved by gRPC itself);
- `dns:///name:port`: every address the name resolves to (a headless Kubernetes Service gives one
  per pod), resolved again every `interval` seconds;
- `file:///path`: addresses in a file (comma or newline separated, `#` comments), read again every
  `interval` seconds (for tooling that writes the list, and for tests).

`resolve()` returns the current set; on a failed lookup it returns None and the caller keeps
what it has, so a DNS hiccup does not drop every engine.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 5.0


@dataclass(frozen=True)
class Discovery:
    target: str

    @property
    def dynamic(self) -> bool:
        return self.target.startswith(("dns:///", "file://"))

    def static(self) -> list[str]:
        return _split(self.target)

    async def resolve(self) -> list[str] | None:
        if self.target.startswith("file://"):
            try:
                text = Path(self.target.removeprefix("file://")).read_text()
            except OSError as exc:
                log.warning("cannot read the engine list %s: %s", self.target, exc)
                return None
            lines = [line.split("#", 1)[0] for line in text.splitlines()]
            return _split(",".join(lines))
        if self.target.startswith("dns:///"):
            return await _resolve_dns(self.target.removeprefix("dns:///"))
        return self.static()


def _split(text: str) -> list[str]:
    out: list[str] = []
    for part in text.replace("\n", ",").split(","):
        part = part.strip()
        if part and part not in out:
            out.append(part)
    return out


async def _resolve_dns(name_port: str) -> list[str] | None:
    host, sep, port = name_port.rpartition(":")
    if not sep or not port.isdigit():
        log.warning("dns target %r needs a port (dns:///name:port)", name_port)
        return None
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except OSError as exc:
        log.warning("cannot resolve %s: %s", host, exc)
        return None
    out: list[str] = []
    for family, *_, addr in infos:
        ip = str(addr[0])
        target = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if target not in out:
            out.append(target)
    return sorted(out)
