"""Where the peer's vLLM lives and the environment it runs in, for this process and its children.

vLLM is carried to the GPU machine as an unpacked site folder (no pip, no network there): it goes
first on sys.path here and on PYTHONPATH for the engine-core and TP worker processes vLLM spawns
and for the OpenAI server subprocess. NVLink multicast stays off in all of them, as in
bench/gpu_env.sh (these machines must not use NVLS/multimem paths).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from bench.common import jsonl

DEFAULT_SITE = "/tmp/vsite"

# Kept in every process the peer starts (vLLM's own workers inherit os.environ).
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
# FlashInfer is not in the carried site, so vLLM's FlashInfer sampler must stay off (it only
# serves top-k/top-p, which no workload here uses); no hub, no usage reports: no network there.
DEFAULTS = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-site", default=os.environ.get("PEER_VSITE", DEFAULT_SITE),
                        help="folder holding vllm/ (default: $PEER_VSITE or /tmp/vsite)")
    parser.add_argument("--json", default=None, help="append the result as a JSON line here")


def check_site(site: str) -> Path:
    """The site folder, or exit 2 with a message saying what is missing and how to get it."""
    path = Path(site)
    if not (path / "vllm" / "__init__.py").is_file():
        sys.stderr.write(
            f"bench.peer: no vLLM at --vllm-site {site} (expected {path}/vllm/__init__.py). "
            "Unpack one there first (docs/benchmarks.md, 'Peer (vLLM) in the same call': "
            "bash .peer/install.sh in two device calls), or pass --vllm-site.\n")
        raise SystemExit(2)
    return path.resolve()


def site_version(site: Path) -> str:
    """vLLM's version from its dist-info folder, without importing it (the server runs apart)."""
    infos = sorted(site.glob("vllm-*.dist-info"))
    return infos[0].name[len("vllm-"):-len(".dist-info")] if infos else "?"


def _has_flashinfer(folder: str) -> bool:
    """A path entry holding a FlashInfer package: bench/gpu_env.sh puts ours (0.6.4, for
    minisgl) on PYTHONPATH, and vLLM 0.26 calls FlashInfer APIs that 0.6.4 lacks (its engine
    core then fails to start: `autotune() got an unexpected keyword argument 'cache'`). vLLM
    runs without it, as its carried site has none."""
    return (Path(folder) / "flashinfer" / "__init__.py").is_file()


def child_env(site: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process running vLLM: the site first on PYTHONPATH, no folder with
    a FlashInfer on it, NVLS off."""
    env = dict(os.environ if base is None else base)
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not _has_flashinfer(p)]
    env["PYTHONPATH"] = os.pathsep.join([str(site), *kept])
    for key, value in DEFAULTS.items():
        env.setdefault(key, value)
    env.update(NVLS_OFF)  # never inherited as "on"
    return env


def activate(site: str) -> Path:
    """Make `import vllm` find the carried site in this process and in the ones vLLM spawns."""
    path = check_site(site)
    os.environ.update(child_env(path))
    sys.path[:] = [str(path), *(p for p in sys.path if not (p and _has_flashinfer(p)))]
    return path


def import_vllm(site: str) -> Any:
    """`activate` then import vllm; an import failure exits 2 with the reason, not a traceback."""
    activate(site)
    try:
        import vllm
    except Exception as exc:  # a broken or partial site (e.g. only part1 unpacked)
        sys.stderr.write(f"bench.peer: importing vllm from {site} failed: {exc!r}\n")
        raise SystemExit(2) from None
    return vllm


def flashinfer_visible(env: dict[str, str] | None = None) -> bool:
    """Whether vLLM's processes could import a FlashInfer (the carried site has none, and
    `child_env` takes ours off the path): recorded, since vLLM picks kernels from one it finds.
    Without `env`: this process (vLLM in-process, after `activate`); with it: a child started
    with that environment (the OpenAI server of bench.peer.serving), whose path is its
    PYTHONPATH, not ours."""
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep) + sys.path if env is None \
        else env.get("PYTHONPATH", "").split(os.pathsep)
    return any(p and _has_flashinfer(p) for p in paths)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def emit(record: dict[str, Any], json_path: str | None) -> None:
    print(json.dumps(record), flush=True)
    jsonl.append(json_path, [record])


def shutdown_and_exit(llm: Any) -> None:
    """Stop vLLM's engine-core child, then leave at once: its atexit hooks can hang on a
    finished run, holding the device call open."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001 (the result is already written)
        print(f"bench.peer: shutdown: {exc!r}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
