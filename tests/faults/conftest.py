"""One stack for the fault tests (tests/faults/chaos.py): services die and come back in it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from minisgl.launcher import Stack, StackConfig
from minisgl_core.ports import free_port

from .chaos import Chaos


@pytest.fixture(scope="package")
def chaos(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    log_dir = tmp_path_factory.mktemp("faults")
    config = StackConfig(
        model_path=str(tiny_model_path), http_port=free_port(), grpc_port=free_port(),
        internal_ports=dict.fromkeys(("worker", "tokenizer", "detokenizer", "scheduler"), 0),
        extra_args={"gateway": ["--retry-after", "1"]}, log_dir=log_dir, metrics=False)
    chaos = Chaos(Stack(config).start(), log_dir)
    try:
        yield chaos
    finally:
        codes = chaos.close()
        assert all(code == 0 for code in codes.values()), codes
