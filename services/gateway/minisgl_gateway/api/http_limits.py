"""Bounds on the HTTP request head and body, which uvicorn's httptools protocol does not have.

uvicorn with httptools (the gateway's parser: see pyproject.toml) buffers request headers without
limit and waits for heads and bodies without a deadline, so one client could park megabytes of
headers or hold connections open by sending a byte now and then. This protocol, a subclass of
uvicorn's, answers
- 431 when the head (request line + headers) passes `max_header_bytes` or holds more than
  `max_headers` fields,
- 408 and closes when a head is not complete `header_timeout_s` after its connection opened or its
  first byte arrived,
- 408 (OpenAI error JSON) and closes when a body is not complete `body_timeout_s` after its head,
- 429 (OpenAI error JSON, Retry-After) to a request with a body while `max_body_readers` bodies
  are being received: connections waiting on a body are bounded like requests in flight,
then closes the connection. Other framing errors keep uvicorn's answer: 400 text/plain "Invalid HTTP
request received.".
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from minisgl_gateway import metrics
from minisgl_gateway.errors import ApiError, overloaded

log = logging.getLogger(__name__)

_REASONS = {408: b"Request Timeout", 429: b"Too Many Requests",
            431: b"Request Header Fields Too Large"}
BODY_TIMED_OUT = "minisgl.body_timed_out"  # scope key: the body deadline passed (read_body)


class BodyReaders:
    """Requests of one server whose body is still arriving (shared by its connections)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0


class _HeadRefused(Exception):
    pass


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    max_header_bytes = 64 * 1024
    max_headers = 100
    header_timeout_s = 10.0
    body_timeout_s = 30.0
    retry_after_s = 1
    readers = BodyReaders(512)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._head_fields = 0
        self._refusal: tuple[int, str] | ApiError | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._reading_body = False  # holds one of `readers`

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
        self._body_done()
        super().connection_lost(exc)

    # -- the body's deadline and the readers' bound ------------------------------------------

    def _has_body(self) -> bool:
        for name, value in self.headers:
            if name == b"transfer-encoding" or (name == b"content-length"
                                                 and value.strip() not in (b"0", b"")):
                return True
        return False

    def _body_begins(self) -> None:
        self._reading_body = True
        self.readers.count += 1
        self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_too_slow)

    def _body_done(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self._reading_body:
            self._reading_body = False
            self.readers.count -= 1

    def _body_too_slow(self) -> None:
        self._body_timer = None
        if self.flow.read_paused:  # the server is not reading (flow control): not the client
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_too_slow)
            return
        self._body_done()
        if self.transport.is_closing():
            return
        metrics.HTTP_REFUSED.labels("body_timeout").inc()
        cycle = self.cycle
        if cycle is not None:
            # The app reading the body sees a disconnect, not an error to log (read_body).
            cycle.scope[BODY_TIMED_OUT] = True  # type: ignore[literal-required]
            if cycle.response_started:  # a response is going out: just hang up
                self.transport.close()
                return
            cycle.disconnected = True  # what the app sends from here on goes nowhere
            cycle.message_event.set()
        # The request being refused is this cycle's own, whose response has not started.
        self._answer(ApiError(408, f"the request body was not received within "
                                   f"{self.body_timeout_s:g}s", code="request_timeout"))

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
        has_body = self._has_body()
        if has_body and self.readers.count >= self.readers.limit:
            metrics.HTTP_REFUSED.labels("body_readers").inc()
            self._refusal = overloaded(
                f"too many request bodies being received (limit {self.readers.limit}); retry "
                "later", self.retry_after_s)
            raise _HeadRefused  # answered by send_400_response, before any app work
        super().on_headers_complete()
        if has_body:
            self._body_begins()

    def on_message_complete(self) -> None:
        self._body_done()
        super().on_message_complete()

    # -- refusing ----------------------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        if isinstance(self._refusal, ApiError):
            self._refuse(self._refusal)
        elif self._refusal is not None:
            self._refuse(*self._refusal)
        else:
            super().send_400_response(msg)

    def _responding(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse(self, status: int | ApiError, msg: str = "") -> None:
        """A plain-text refusal (`status`, `msg`), or an ApiError as OpenAI error JSON."""
        self._in_head = False
        self._disarm_head_timer()
        self._body_done()
        if self._responding():  # never write into a response in flight: just hang up
            self.transport.close()
            return
        self._answer(status, msg)

    def _answer(self, status: int | ApiError, msg: str = "") -> None:
        """Writes the refusal and closes the connection."""
        if isinstance(status, ApiError):
            err, status = status, status.status
            body = json.dumps(err.body()).encode()
            extra = [b"content-type: application/json\r\n",
                     *(f"{k.lower()}: {v}\r\n".encode() for k, v in err.headers().items())]
        else:
            body = msg.encode()
            extra = [b"content-type: text/plain; charset=utf-8\r\n"]
        self.transport.write(b"".join([
            b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]),
            *(name + b": " + value + b"\r\n" for name, value in
              self.server_state.default_headers),
            *extra, b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n",
            body]))
        self.transport.close()


def client_gone(request: Request) -> ApiError:
    """A client that hung up (or ran out of time, see http_limits) while sending its body: an
    everyday event, counted, logged at debug only. The 499 it raises reaches no one."""
    if not request.scope.get(BODY_TIMED_OUT):  # counted with the 408 it got
        metrics.CLIENT_DISCONNECTS.labels("body").inc()
    log.debug("client went away while sending the request body")
    return ApiError(499, "the client disconnected", code="client_disconnected")


def limited_protocol(max_header_bytes: int, max_headers: int, header_timeout_s: float,
                     body_timeout_s: float = 30.0, max_body_readers: int = 512,
                     retry_after_s: int = 1) -> type[LimitedHttpToolsProtocol]:
    """The protocol class to give uvicorn (`Config(http=...)`), with these limits; its
    connections share one count of bodies being received."""
    return type("GatewayHttpProtocol", (LimitedHttpToolsProtocol,), {
        "max_header_bytes": max_header_bytes, "max_headers": max_headers,
        "header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s,
        "readers": BodyReaders(max_body_readers), "retry_after_s": retry_after_s})


__all__ = ["BODY_TIMED_OUT", "LimitedHttpToolsProtocol", "client_gone", "limited_protocol"]
