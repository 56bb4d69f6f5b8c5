"""Every Triton kernel case in sm90_compile.py compiles for an H100 (sm_90) here, without a GPU:
the GPU-only paths (programmatic dependent launch, inline PTX, system-scope atomics, fp8 and wgmma
products) that the interpreter tests cannot reach. A subprocess: the interpreter is chosen when a
kernel is decorated, and this process's kernels are interpreted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_worker_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    run = subprocess.run([sys.executable, str(HERE / "sm90_compile.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    ok = [line for line in run.stdout.splitlines() if line.startswith("ok ")]
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    cases = int(run.stdout.splitlines()[-1].split()[0])
    assert len(ok) == cases >= 20, run.stdout
