"""Internal mTLS material for benchmark stacks: a fresh CA and service certificates."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path


def make_certs() -> str:
    """A fresh CA and service certificates (scripts/gen_internal_certs.py) in a temp dir."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "gen_internal_certs.py"
    spec = importlib.util.spec_from_file_location("gen_internal_certs", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    out = tempfile.mkdtemp(prefix="minisgl-certs-")
    module.generate(Path(out))
    return out
