"""Long-lived processes freeze their start-up objects out of the garbage collector's reach: every
gRPC service when it starts serving, the gateway, and the in-process LLM (until close)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from minisgl_core.gc_pause import freeze_startup_objects, thaw
from minisgl_core.serving import ServiceHost


def _tracked(obj: object) -> bool:
    """Whether the collector's generations (not the frozen set) hold obj."""
    return any(o is obj for o in gc.get_objects())


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_freeze_and_thaw() -> None:
    alive = [object()]  # a container the collector tracks
    garbage = weakref.ref(_Node())  # a cycle nobody references: collected first, not frozen
    try:
        assert freeze_startup_objects() > 0
        assert garbage() is None
        assert not _tracked(alive)
    finally:
        thaw()
    assert gc.get_freeze_count() == 0 and _tracked(alive)


def test_service_host_freezes_while_serving() -> None:
    before = [object()]
    host = ServiceHost("gc-test", "127.0.0.1", 0)
    try:
        host.start()
        assert gc.get_freeze_count() > 0 and not _tracked(before)
    finally:
        host.stop(drain_timeout=0.5)
    assert gc.get_freeze_count() == 0 and _tracked(before)  # thawed on stop


def test_llm_freezes_on_construction_and_thaws_on_close(tiny_model_path: Path) -> None:
    from minisgl.llm import LLM

    llm = LLM(str(tiny_model_path))
    try:
        assert gc.get_freeze_count() > 0 and not _tracked(llm.engine.model)
    finally:
        llm.close()
    assert gc.get_freeze_count() == 0
