"""Request ids and trace spans in the tokenizer and detokenizer.

Tokenize is a unary call per gateway request: its `x-request-id` and `traceparent` come in the
call's metadata. Detokenize is one long-lived stream for many requests: a request's id and trace
context come in its first `DetokenizeUpdate`, and its span lasts until its finishing update.
Nothing here runs unless tracing is on or debug logging is (`StreamRequests.active`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from minisgl_core import tracing
from minisgl_core.logging import REQUEST_ID, log_fields
from minisgl_core.proto.minisgl.v1 import detokenizer_pb2

if TYPE_CHECKING:  # opentelemetry is imported at run time only with tracing on
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)


@contextlib.contextmanager
def tokenize_scope(metadata: Any, num_items: int) -> Iterator[None]:
    """The caller's request id in this thread's log lines; a server span when traced."""
    rid = ""
    for key, value in metadata or ():
        if key == "x-request-id" and isinstance(value, str):
            rid = value
    token = REQUEST_ID.set(rid)
    span: Span | None = None
    if tracing.ENABLED:
        from opentelemetry.trace import SpanKind

        parent = tracing.context_from_metadata(metadata)
        if parent is not None:
            span = tracing.start_span("tokenize", parent, {"minisgl.items": num_items,
                                                           "minisgl.request_id": rid},
                                      kind=SpanKind.SERVER)
    try:
        yield
        if rid:
            log.debug("tokenized %d prompt(s)", num_items)
    finally:
        if span is not None:
            span.end()
        REQUEST_ID.reset(token)


class StreamRequests:
    """One Detokenize stream's traced / logged requests: rid -> (request id, span or None)."""

    def __init__(self) -> None:
        self.active = tracing.ENABLED or log.isEnabledFor(logging.DEBUG)
        self._live: dict[int, tuple[str, Span | None]] = {}

    def observe(self, updates: Iterable[detokenizer_pb2.DetokenizeUpdate]) -> None:
        live = self._live
        for u in updates:
            if u.traceparent or u.request_id:
                span = None
                if u.traceparent and tracing.ENABLED:
                    span = tracing.start_span("detokenize", u.traceparent,
                                              {"minisgl.request_id": u.request_id})
                live[u.rid] = (u.request_id, span)
                log.debug("detokenizing", extra=log_fields(request_id=u.request_id, rid=u.rid))
            if u.finished and u.rid in live:
                request_id, span = live.pop(u.rid)
                if span is not None:
                    span.end()
                log.debug("detokenized", extra=log_fields(request_id=request_id, rid=u.rid))

    def close(self) -> None:
        """The stream ended: spans of requests still open end here."""
        for _, span in self._live.values():
            if span is not None:
                span.end()
        self._live.clear()
