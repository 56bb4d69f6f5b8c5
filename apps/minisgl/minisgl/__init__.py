"""minisgl: the local launcher (`minisgl serve`), the shell and the in-process `LLM` class."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# Everything this package starts is fork + exec (the launcher's services, TP ranks). gRPC's fork
# handlers, on in some grpcio builds, park its threads around fork() and can deadlock there while
# a channel polls (a CI run hung in Popen this way; grpc/grpc#17986, #22624). They exist for
# children that keep using gRPC after fork, which ours never do. Set before grpc initialises;
# children inherit it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

if TYPE_CHECKING:
    from minisgl.llm import LLM

__all__ = ["LLM"]


def __getattr__(name: str) -> Any:
    # Lazy: `import minisgl` must stay cheap for the launcher and the shell.
    if name == "LLM":
        from minisgl.llm import LLM

        return LLM
    raise AttributeError(name)
