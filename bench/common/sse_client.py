"""A lean streaming client for the load generator: one HTTP/1.1 POST on a plain asyncio
connection, its chunked body read as server-sent events.

Why not httpx (what the `openai` client uses, and what bench.serving used before): it spends
~66 µs of CPU per streamed token, so one load-generator process saturated its core at ~15k
tokens/s and the HTTP rows measured the client (docs/benchmarks/log/2026-11-24-11.md). This
reads a chunk with two awaits and parses one JSON object per event. It speaks only what the
gateway sends: a status line, headers, then a chunked or Content-Length body; no TLS, proxies or redirects.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HttpError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


async def _headers(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status = int((await reader.readuntil(b"\r\n")).split(b" ", 2)[1])
    headers = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _chunks(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while size := int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16):
            yield (await reader.readexactly(size + 2))[:-2]
        return
    if "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        yield await reader.read()


async def stream_events(url: str, path: str, body: dict) -> AsyncIterator[dict]:
    """POSTs body as JSON to url + path and yields each `data:` event's JSON until [DONE].
    A status other than 200 raises HttpError with the start of the body."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    try:
        payload = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                     "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                     .encode() + payload)
        status, headers = await _headers(reader)
        if status != 200:
            raise HttpError(status, b"".join([c async for c in _chunks(reader, headers)]))
        pending = b""
        async for chunk in _chunks(reader, headers):
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data: "):
                        continue
                    if line == b"data: [DONE]":
                        return
                    yield json.loads(line[6:])
    finally:
        writer.close()
