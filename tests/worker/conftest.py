"""Fixtures for the worker tests: tiny HF checkpoints, built once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from .tiny_models import save_tiny


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = save_tiny(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return made[arch]

    return get
