"""Generate the Python stubs of protos/ into libs/minisgl_core/minisgl_core/proto/, reproducibly.

The generator is pinned (grpcio-tools==GRPC_TOOLS_VERSION, installed into a private folder so it never
fights the runtime's protobuf version). Two lines of the output are rewritten so that the stubs import
under every protobuf runtime from 5.26 to 7.x and every grpcio from 1.66 on: the generated runtime
version guards would otherwise demand a runtime at least as new as the generator.

    python scripts/gen_protos.py            # write the stubs
    python scripts/gen_protos.py --check    # exit 1 if the checked-in stubs are stale
"""

from __future__ import annotations

import argparse
import filecmp
import re
import subprocess
import sys
import tempfile
from pathlib import Path

GRPC_TOOLS_VERSION = "1.71.0"
ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"
OUT_ROOT = ROOT / "libs" / "minisgl_core" / "minisgl_core" / "proto"
TOOLS_DIR = ROOT / ".cache" / f"grpcio-tools-{GRPC_TOOLS_VERSION}"
PACKAGE_PREFIX = "minisgl_core.proto."


def ensure_tools() -> None:
    if (TOOLS_DIR / "grpc_tools").is_dir():
        return
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(TOOLS_DIR),
         f"grpcio-tools=={GRPC_TOOLS_VERSION}"],
        check=True,
    )


def _postprocess(path: Path) -> None:
    text = path.read_text()
    # Drop the runtime version guards (see the module docstring).
    text = re.sub(r"from google\.protobuf import runtime_version as _runtime_version\n", "", text)
    text = re.sub(r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)\n", "", text)
    text = re.sub(r"GRPC_GENERATED_VERSION = .*?\n    \)\n", "", text, flags=re.S)
    # Generated imports are relative to protos/; make them absolute inside our package.
    text = re.sub(r"^from minisgl\.v1 import", f"from {PACKAGE_PREFIX}minisgl.v1 import", text,
                  flags=re.M)
    text = re.sub(r"^import minisgl\.v1\.", f"import {PACKAGE_PREFIX}minisgl.v1.", text, flags=re.M)
    path.write_text(text)


def generate(out_root: Path) -> None:
    ensure_tools()
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    cmd = [
        sys.executable, "-c",
        "import sys; sys.path.insert(0, sys.argv[1]); from grpc_tools import protoc; "
        "import importlib.resources as r; inc = str(r.files('grpc_tools') / '_proto'); "
        "sys.exit(protoc.main(['protoc', '-I' + sys.argv[2], '-I' + inc] + sys.argv[3:]))",
        str(TOOLS_DIR), str(PROTO_ROOT),
        f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}",
        *protos,
    ]
    out_root.mkdir(parents=True, exist_ok=True)
    subprocess.run(cmd, check=True)
    for py in out_root.rglob("*.py*"):
        if py.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")):
            _postprocess(py)
    for folder in [out_root, *[d for d in out_root.rglob("*") if d.is_dir()]]:
        (folder / "__init__.py").touch()


def stale_files(built: Path, checked_in: Path) -> list[str]:
    built_files = {p.relative_to(built) for p in built.rglob("*") if p.is_file()}
    have_files = {
        p.relative_to(checked_in) for p in checked_in.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    stale = sorted(str(p) for p in built_files ^ have_files)
    stale += sorted(
        str(p) for p in built_files & have_files
        if not filecmp.cmp(built / p, checked_in / p, shallow=False)
    )
    return stale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if checked-in stubs are stale")
    args = parser.parse_args()
    if not args.check:
        generate(OUT_ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = stale_files(Path(tmp), OUT_ROOT)
    if stale:
        print("stale generated stubs (run `make protos`):", *stale, sep="\n  ")
        return 1
    print("generated stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
