"""Shared fixtures: the embedded model and the real five-process stack on free loopback ports."""

from __future__ import annotations

import os

# No GPU here: Triton kernels run in Triton's interpreter. It must be chosen before anything
# imports triton, and any test module may be the first to do so.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests fork+exec services while gRPC channels of earlier tests poll: no gRPC fork handlers
# (see apps/minisgl/minisgl/__init__.py).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from collections.abc import Iterator  # noqa: E402
from pathlib import Path

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ROOT / "models" / "tiny"


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    if not (TINY_MODEL / "config.json").exists():
        pytest.fail(f"the embedded model is missing at {TINY_MODEL}")
    return TINY_MODEL


@pytest.fixture(scope="session")
def stack(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """gateway, tokenizer, detokenizer, scheduler and worker as real processes, started once."""
    from minisgl.launcher import Stack, StackConfig
    from minisgl_core.ports import free_port

    config = StackConfig(
        model_path=str(tiny_model_path),
        http_port=free_port(),
        grpc_port=free_port(),
        internal_ports={"worker": 0, "tokenizer": 0, "detokenizer": 0, "scheduler": 0},
        log_dir=tmp_path_factory.mktemp("stack-logs"),
        log_level="info",
        # Tests across the suite call the internal services directly; tests/e2e/test_internal_auth.py
        # covers the token and mTLS (the launcher's default is a token).
        internal_token=False,
    )
    stack = Stack(config).start()
    try:
        yield stack
    finally:
        codes = stack.stop()
        # A clean drain is part of the contract: every service exits 0 on SIGTERM.
        assert all(code == 0 for code in codes.values()), codes
