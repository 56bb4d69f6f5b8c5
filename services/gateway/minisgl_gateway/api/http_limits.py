"""Bounds on the HTTP request head, which uvicorn's httptools protocol does not have.

uvicorn with httptools (the gateway's parser: see pyproject.toml) buffers request headers without
limit and waits for them without a deadline, so one client could park megabytes of headers or hold
connections open by sending a byte now and then. This protocol, a subclass of uvicorn's, answers
- 431 when the head (request line + headers) passes `max_header_bytes` or holds more than
  `max_headers` fields,
- 408 and closes when a head is not complete `header_timeout_s` after its connection opened or its
  first byte arrived,
then closes the connection. Other framing errors keep uvicorn's answer: 400 text/plain "Invalid HTTP
request received.".
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class _HeadRefused(Exception):
    pass


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    max_header_bytes = 64 * 1024
    max_headers = 100
    header_timeout_s = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._head_fields = 0
        self._refusal: tuple[int, str] | None = None
        self._head_timer: asyncio.TimerHandle | None = None

    # -- the head's deadline -----------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_too_slow)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._responding():  # a pipelined head behind a response still going: wait for it
            self._arm_head_timer()
            return
        if self._in_head and not self.transport.is_closing():
            self._refuse(408, f"request headers not received within {self.header_timeout_s:g}s")

    # uvicorn's TCP server always hands a stream Transport (asyncio types it BaseTransport).
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    # -- the head's size ---------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # A single header larger than a read is buffered by httptools before any callback:
        # counting the bytes of an unfinished head catches it after one more read at most.
        if self._in_head and self._head_bytes > self.max_header_bytes \
                and not self.transport.is_closing():
            self._refuse(431, f"request headers exceed {self.max_header_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_fields = 0
        self._arm_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_fields += 1
        if self._head_fields > self.max_headers:
            self._refusal = (431, f"more than {self.max_headers} request header fields")
            raise _HeadRefused  # httptools turns it into HttpParserCallbackError
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._disarm_head_timer()
        super().on_headers_complete()

    # -- refusing ----------------------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        if self._refusal is not None:
            self._refuse(*self._refusal)
            return
        super().send_400_response(msg)

    def _responding(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse(self, status: int, msg: str) -> None:
        self._in_head = False
        self._disarm_head_timer()
        if self._responding():  # never write into a response in flight: just hang up
            self.transport.close()
            return
        body = msg.encode()
        self.transport.write(b"".join([
            b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]),
            *(name + b": " + value + b"\r\n" for name, value in
              self.server_state.default_headers),
            b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body]))
        self.transport.close()


def limited_protocol(max_header_bytes: int, max_headers: int, header_timeout_s: float
                     ) -> type[LimitedHttpToolsProtocol]:
    """The protocol class to give uvicorn (`Config(http=...)`), with these limits."""
    return type("GatewayHttpProtocol", (LimitedHttpToolsProtocol,), {
        "max_header_bytes": max_header_bytes, "max_headers": max_headers,
        "header_timeout_s": header_timeout_s})


__all__ = ["LimitedHttpToolsProtocol", "limited_protocol"]
