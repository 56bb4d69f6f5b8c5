"""tests/gpu: checks of the CUDA kernels and engine that only a GPU can run (`make test-gpu`).

Every test here carries the `gpu` marker and is skipped where torch sees no CUDA device, so
`make test` on a CPU machine collects them and skips them. On the GPU machine Triton must compile
for the device, not run in the interpreter the CPU tests select (tests/conftest.py sets
TRITON_INTERPRET=1 unless it is already set): `make test-gpu` sets TRITON_INTERPRET=0.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        reason = "needs a CUDA device (make test-gpu on the GPU machine)"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        reason = "TRITON_INTERPRET=1 would run the kernels in Triton's interpreter: set it to 0"
    else:
        reason = ""
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.gpu)
            # FlashInfer compiles its kernels on a fresh machine (minutes), and a check walks every
            # backend: more than the suite's per-test timeout.
            item.add_marker(pytest.mark.timeout(1800))
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def qwen3_06b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-0.6B's config with the synthetic tokenizer; weights come from --load-format dummy."""
    from bench.common.model_dir import make

    return make(str(ROOT / "models" / "configs" / "Qwen3-0.6B"), str(tmp_path_factory.mktemp("q06")))
