"""minisgl: the local launcher (`minisgl serve`), the shell and the in-process `LLM` class."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minisgl.llm import LLM

__all__ = ["LLM"]


def __getattr__(name: str) -> Any:
    # Lazy: `import minisgl` must stay cheap for the launcher and the shell.
    if name == "LLM":
        from minisgl.llm import LLM

        return LLM
    raise AttributeError(name)
