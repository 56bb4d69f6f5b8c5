"""Logging for every service, one call at process start: JSON lines or text, with request ids.

`--log-format auto` (the default) writes text when stderr is a terminal and JSON lines otherwise
(what log collectors read). A line about one request carries its `request_id` (the client's
`x-request-id`, or one the gateway generated): from `log_fields(request_id=...)`, or from the
`REQUEST_ID` context variable that the gateway sets for the task serving the request.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

LOG_FORMATS = ("auto", "text", "json")
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
# What `ServiceFlags.parse` read from --log-format; setup_logging uses it when given no format.
default_format = "auto"


def _timestamp(record: logging.LogRecord) -> str:
    return (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z")


def _fields(record: logging.LogRecord) -> dict[str, object]:
    extra = getattr(record, "fields", None)
    fields = dict(extra) if isinstance(extra, dict) else {}
    if "request_id" not in fields:
        rid = REQUEST_ID.get()
        if rid:
            fields["request_id"] = rid
    return fields


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(_fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """`HH:MM:SS.mmm LEVEL service: message key=value ...`, for people at a terminal."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        clock = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = (f"{clock}.{int(record.msecs):03d} {record.levelname:<7} {self.service}: "
                f"{record.getMessage()}")
        fields = _fields(record)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def resolve_format(fmt: str | None, stream: object = None) -> str:
    """"text" or "json": `auto` is text on a terminal, JSON otherwise."""
    fmt = (fmt or default_format or "auto").lower()
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: one of {', '.join(LOG_FORMATS)}")
    if fmt == "auto":
        isatty = getattr(stream if stream is not None else sys.stderr, "isatty", None)
        return "text" if isatty is not None and isatty() else "json"
    return fmt


def setup_logging(service: str, level: str = "info", fmt: str | None = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    chosen = resolve_format(fmt, sys.stderr)
    handler.setFormatter(TextFormatter(service) if chosen == "text" else JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def log_fields(**fields: object) -> dict[str, dict[str, object]]:
    """`logger.info("msg", extra=log_fields(rid=1))` adds keys to the line."""
    return {"fields": fields}
