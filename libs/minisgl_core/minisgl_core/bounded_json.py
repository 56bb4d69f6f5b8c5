"""JSON from untrusted text with its nesting bounded: one rule for every service.

`json.loads` recurses: a value nested thousands of levels deep raises RecursionError (a 500, or an
INTERNAL / UNAVAILABLE status, and the exception text leaked to the client), and a value a little
under that depth still breaks whatever walks it next (a chat template, a schema compiler).
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 64  # arrays/objects inside one another; no real schema or tool list comes close


class TooDeep(ValueError):
    """The value nests past the bound."""


def nests_past(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether arrays/objects in `value` nest more than `limit` levels (iterative: a value too
    deep for recursion is still measured)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            if depth >= limit:
                return True
            stack.extend((v, depth + 1) for v in item if isinstance(v, list | dict))
    return False


def loads_bounded(text: str, name: str = "the JSON value", limit: int = MAX_JSON_DEPTH) -> Any:
    """json.loads, raising TooDeep (a ValueError naming `name`) past `limit` levels and
    json.JSONDecodeError (also a ValueError) for invalid text; never RecursionError."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(f"{name} nests more than {limit} levels deep") from None
    if nests_past(value, limit):
        raise TooDeep(f"{name} nests more than {limit} levels deep")
    return value
