"""The contracts: buf lint, no breaking change, fresh stubs, and stubs that import on every runtime."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUF_DIR = ROOT / "tools" / "buf"
BUF = BUF_DIR / "node_modules" / ".bin" / "buf"
CACHE = ROOT / ".cache"
STUB_PACKAGE = "minisgl_core.proto.minisgl.v1"
PROTO_MODULES = ["common", "generation", "tokenizer", "detokenizer", "scheduler", "worker"]


def _buf() -> Path:
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: buf (an npm package) cannot run here")
    if not BUF.exists():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=BUF_DIR,
                       check=True)
    return BUF


def test_buf_lint() -> None:
    result = subprocess.run([str(_buf()), "lint"], cwd=ROOT / "protos", capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_protos_follow_versioned_layout() -> None:
    files = sorted((ROOT / "protos" / "minisgl" / "v1").glob("*.proto"))
    assert [f.stem for f in files] == sorted(PROTO_MODULES)
    for f in files:
        text = f.read_text()
        assert "package minisgl.v1;" in text, f
        assert 'syntax = "proto3";' in text, f


def test_no_breaking_change_since_previous_commit() -> None:
    buf = _buf()
    base = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD~1:protos"], cwd=ROOT,
                          capture_output=True, text=True)
    if base.returncode != 0:
        pytest.skip("no previous commit with protos/ to compare against (shallow clone or first)")
    result = subprocess.run(
        [str(buf), "breaking", "--against", f"{ROOT}/.git#ref=HEAD~1,subdir=protos"],
        cwd=ROOT / "protos", capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_checked_in_stubs_are_fresh() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("version", ["5.26.1", "5.29.5", "6.33.6", "7.36.2"])
def test_stubs_import_under_protobuf_runtime(version: str) -> None:
    target = CACHE / f"protobuf-{version}"
    if not (target / "google" / "protobuf").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(target), f"protobuf=={version}"], check=True)
    code = (
        "import google.protobuf as pb, importlib, sys\n"
        f"assert pb.__version__ == '{version}', pb.__version__\n"
        f"for name in {PROTO_MODULES!r}:\n"
        f"    m = importlib.import_module('{STUB_PACKAGE}.' + name + '_pb2')\n"
        f"    importlib.import_module('{STUB_PACKAGE}.' + name + '_pb2_grpc')\n"
        f"from {STUB_PACKAGE} import worker_pb2\n"
        "msg = worker_pb2.StepRequest(step_id=3)\n"
        "msg.requests.add(rid=1, input_ids=[1, 2, 3]).sampling.temperature = 0.5\n"
        "again = worker_pb2.StepRequest.FromString(msg.SerializeToString())\n"
        "assert again.requests[0].input_ids == [1, 2, 3]\n"
        "assert again.requests[0].sampling.HasField('temperature')\n"
    )
    env_path = f"{target}:{ROOT / 'libs' / 'minisgl_core'}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
