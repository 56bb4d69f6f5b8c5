"""Raw request bodies: JSON parsed with bounds (strict UTF-8, no NaN, bounded depth, arrays and
strings no larger than any prompt that fits the context window), and the body size no such request
can exceed."""

from __future__ import annotations

import json
from typing import Any

from minisgl_core.serving import BYTES_PER_CONTEXT_TOKEN

from minisgl_gateway.errors import invalid


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
    _check_strings(value, 0, max_items, max_items * BYTES_PER_CONTEXT_TOKEN)
    return value


def _check_strings(value: Any, depth: int, max_items: int = 0, max_chars: int = 0,
                   param: str | None = None) -> None:
    """`param`: the top-level field `value` is in (named in the error)."""
    # JSON escapes can produce lone surrogates ("\ud800"), which are not UTF-8-encodable text.
    if depth > 64:
        raise invalid("the request body nests too deeply")
    if max_items and isinstance(value, list | dict) and len(value) > max_items:
        raise invalid(f"an array or object in the request body has {len(value)} items; at most "
                      f"{max_items} are allowed (the context window)",
                      param=param, code="context_length_exceeded")
    if isinstance(value, str):
        if max_chars and len(value) > max_chars:
            raise invalid(f"a string in the request body has {len(value)} characters; no prompt "
                          f"longer than {max_chars} fits the context window",
                          param=param, code="context_length_exceeded")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid("the request body contains an invalid unicode escape") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            field = k if depth == 0 and isinstance(k, str) else param
            _check_strings(k, depth + 1, max_items, max_chars, field)
            _check_strings(v, depth + 1, max_items, max_chars, field)
    elif isinstance(value, list):
        for v in value:
            _check_strings(v, depth + 1, max_items, max_chars, param)


MIN_CONTEXT_BODY_BYTES = 1024 * 1024


def context_body_limit(max_model_len: int) -> int:
    """The largest body a request whose prompt fits a context window of `max_model_len` tokens can
    need: every token as text at its worst (BYTES_PER_CONTEXT_TOKEN), twice for JSON escapes and
    structure, and 64 KiB for the other fields; never under 1 MiB. A larger body is refused
    before it is parsed, whatever `--max-body-bytes` allows (parsing 8 MiB of token ids holds the
    GIL for ~0.1-0.2 s, a pause every stream of the gateway would feel)."""
    return max(MIN_CONTEXT_BODY_BYTES, 2 * BYTES_PER_CONTEXT_TOKEN * max_model_len + 64 * 1024)


__all__ = ["MIN_CONTEXT_BODY_BYTES", "context_body_limit", "parse_json"]
