"""Progress bars for long waits at a terminal (weight loading, CUDA-graph capture, benchmarks).

`progress(items, total, desc)` wraps an iterable in a tqdm bar on stderr when stderr is a
terminal; otherwise (logs collected by a supervisor, CI, `MINISGL_PROGRESS=0`) it returns the
iterable untouched, so nothing extra reaches the log stream.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def enabled() -> bool:
    if os.environ.get("MINISGL_PROGRESS", "").strip().lower() in ("0", "false", "no", "off"):
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty is not None and isatty())


def progress(items: Iterable[T], total: int | None = None, desc: str = "",
             unit: str = "it") -> Iterable[T]:
    if not enabled():
        return items
    from tqdm import tqdm

    return tqdm(items, total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                dynamic_ncols=True)


class Counter:
    """A bar advanced by hand (`update(n)`), e.g. requests finished in a benchmark; a no-op when
    bars are off."""

    def __init__(self, total: int | None, desc: str = "", unit: str = "it") -> None:
        self._bar = None
        if enabled():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                             dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Counter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

