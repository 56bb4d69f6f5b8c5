"""The engine: the Engine the service drives (engine.py), one rank's work (runner.py) and the
other TP ranks' loop (follower.py), plan -> device batch (batch.py), decode CUDA graphs
(cuda_graph.py), prefill and mixed steps in pieces (piecewise_graph.py). The sampler is its own
package, below this one (minisgl_worker.sampling)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import EngineConfig
from .batch import InvalidPlan

if TYPE_CHECKING:
    from .engine import Engine


def __getattr__(name: str) -> object:
    """`Engine` is loaded on first use: a follower rank imports this package for its runner and
    never loads the Engine module."""
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Engine", "EngineConfig", "InvalidPlan"]
