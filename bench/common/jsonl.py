"""Appending benchmark records to a `--json` file, one JSON line each."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def append(path: str | None, records: Iterable[dict[str, Any]]) -> None:
    """Append each record as a line to `path`; nothing when no path was given."""
    if not path:
        return
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
