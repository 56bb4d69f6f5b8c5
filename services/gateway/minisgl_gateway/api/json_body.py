"""Raw request bodies: JSON parsed with bounds (strict UTF-8, no NaN, bounded depth, arrays and
strings no larger than any prompt that fits the context window), and the body size no such request
can exceed. The same bounds hold for JSON sent inside a string field (`parse_json_field`: a JSON
schema, gRPC's tools_json, ...) and for the public gRPC API's messages (grpc_schema.py)."""

from __future__ import annotations

import json
from typing import Any

from minisgl_core.bounded_json import MAX_JSON_DEPTH
from minisgl_core.serving import BYTES_PER_CONTEXT_TOKEN

from minisgl_gateway.errors import invalid


def string_limit(max_items: int) -> int:
    """The longest string no request that fits a context window of `max_items` tokens needs
    (0: no limit)."""
    return max_items * BYTES_PER_CONTEXT_TOKEN


def parse_json(raw: bytes, max_items: int = 0) -> Any:
    """Bytes -> JSON value; strict UTF-8, no NaN/Infinity, no lone surrogates, bounded depth.
    `max_items` > 0 (the context window): no array or object may hold more (checked before its
    items are looked at, so a huge token-id prompt is refused before any per-item work), and no
    string more than `max_items` x BYTES_PER_CONTEXT_TOKEN characters (no prompt that long fits;
    the tokenizer's own bound is tighter)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not valid UTF-8 (byte {exc.start})") from None

    def _reject(constant: str) -> None:
        raise ValueError(f"{constant} is not valid JSON")

    try:
        value = json.loads(text, parse_constant=_reject)
    except RecursionError:
        raise invalid("the request body nests too deeply") from None
    except ValueError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    _check_strings(value, 0, max_items, string_limit(max_items))
    return value


def parse_json_field(text: str, param: str, max_items: int = 0) -> Any:
    """JSON sent inside the string field `param`, with the body's bounds (depth, and with
    `max_items` > 0 item counts and string sizes); 400 naming `param` otherwise. Too deep a value
    would otherwise surface as a RecursionError here or wherever it is walked later."""
    if max_items and len(text) > string_limit(max_items):
        raise invalid(f"{param} has {len(text)} characters; no request longer than "
                      f"{string_limit(max_items)} fits the context window", param=param,
                      code="context_length_exceeded")

    def _reject(constant: str) -> None:
        raise ValueError(f"{constant} is not valid JSON")

    try:
        value = json.loads(text, parse_constant=_reject)
    except RecursionError:
        raise invalid(f"{param} nests more than {MAX_JSON_DEPTH} levels deep",
                      param=param) from None
    except ValueError as exc:
        raise invalid(f"{param} is not valid JSON: {exc}", param=param) from None
    _check_strings(value, 0, max_items, string_limit(max_items), param, field=True)
    return value


def _check_strings(value: Any, depth: int, max_items: int = 0, max_chars: int = 0,
                   param: str | None = None, field: bool = False) -> None:
    """`param`: the top-level field `value` is in (named in the error); `field`: `value` is the
    JSON inside that string field rather than the whole body."""
    where = param if field else "the request body"
    # JSON escapes can produce lone surrogates ("\ud800"), which are not UTF-8-encodable text.
    if depth > MAX_JSON_DEPTH:
        raise invalid(f"{where} nests more than {MAX_JSON_DEPTH} levels deep", param=param)
    if max_items and isinstance(value, list | dict) and len(value) > max_items:
        raise invalid(f"an array or object in {where} has {len(value)} items; at most "
                      f"{max_items} are allowed (the context window)",
                      param=param, code="context_length_exceeded")
    if isinstance(value, str):
        if max_chars and len(value) > max_chars:
            raise invalid(f"a string in {where} has {len(value)} characters; no prompt "
                          f"longer than {max_chars} fits the context window",
                          param=param, code="context_length_exceeded")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid(f"{where} contains an invalid unicode escape", param=param) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            sub = k if depth == 0 and isinstance(k, str) and not field else param
            _check_strings(k, depth + 1, max_items, max_chars, sub, field)
            _check_strings(v, depth + 1, max_items, max_chars, sub, field)
    elif isinstance(value, list):
        for v in value:
            _check_strings(v, depth + 1, max_items, max_chars, param, field)


MIN_CONTEXT_BODY_BYTES = 1024 * 1024


def context_body_limit(max_model_len: int) -> int:
    """The largest body a request whose prompt fits a context window of `max_model_len` tokens can
    need: every token as text at its worst (BYTES_PER_CONTEXT_TOKEN), twice for JSON escapes and
    structure, and 64 KiB for the other fields; never under 1 MiB. A larger body is refused
    before it is parsed, whatever `--max-body-bytes` allows (parsing 8 MiB of token ids holds the
    GIL for ~0.1-0.2 s, a pause every stream of the gateway would feel)."""
    return max(MIN_CONTEXT_BODY_BYTES, 2 * BYTES_PER_CONTEXT_TOKEN * max_model_len + 64 * 1024)


__all__ = ["MAX_JSON_DEPTH", "MIN_CONTEXT_BODY_BYTES", "context_body_limit", "parse_json",
           "parse_json_field", "string_limit"]
