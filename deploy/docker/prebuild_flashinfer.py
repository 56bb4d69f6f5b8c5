"""Compile the FlashInfer attention kernels the worker uses, ahead of time, without a GPU.

    FLASHINFER_WORKSPACE_BASE=/opt/flashinfer python prebuild_flashinfer.py [--head-dims 128]

FlashInfer 0.6.4 compiles each attention variant with nvcc the first time a process plans it
(decode ~8 s, paged prefill ~70 s on a 16-core host). The CUDA worker image runs this at build
time so that a pod starts without compiling and without network: it builds the variants in
FlashInfer's JIT cache, then copies each `.so` into FlashInfer's ahead-of-time folder
(`flashinfer/data/aot/<name>/<name>.so`), which FlashInfer loads before it would look for nvcc or
ninja. Only nvcc and the CUDA headers are needed here (no GPU); the target architecture comes from
FLASHINFER_CUDA_ARCH_LIST (default `9.0a`: H100/H200). Kernels for other GPUs, or variants not
listed, are still compiled at run time where nvcc exists; `FLASHINFER_DISABLE_JIT=1` turns that
into an error instead, which is how a run proves that nothing was compiled.

The variants are the ones `minisgl_worker.attention.flashinfer_backend` plans: paged prefill (fa2,
also used by tensor-core decode) and paged decode, no positional encoding in the kernel, no sliding
window, no logits soft cap, int32 indices; query/output in the model dtype, the KV cache in the
model dtype or fp8 (`--kv-cache-dtype fp8_e4m3|fp8_e5m2`). Pass `--fa3` for the fa3 prefill
kernels, which the worker's `auto` backend prefills with on Hopper (the image passes it). Head
dims default to 128 (every config in models/configs); add 64/256 for other models.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

_DTYPES = {"bfloat16", "float16"}
_KV_DTYPES = {"auto", "float8_e4m3fn", "float8_e5m2"}


def _hopper_listed() -> bool:
    """FA3 kernels exist for sm_90 only: with no 9.x in the arch list, --fa3 builds nothing."""
    archs = os.environ.get("FLASHINFER_CUDA_ARCH_LIST", "9.0a").replace(",", " ").split()
    return any(a.startswith("9.") for a in archs)


def _specs(args: argparse.Namespace) -> list:
    import torch
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module

    specs = []
    for name in args.dtypes:
        q = getattr(torch, name)
        for kv_name in args.kv_dtypes:
            kv = q if kv_name == "auto" else getattr(torch, kv_name)
            for hd in args.head_dims:
                # (q, kv, o, idx, head_dim_qk, head_dim_vo, pos_encoding_mode, sliding, soft_cap)
                common = (q, kv, q, torch.int32, hd, hd, 0, False, False)
                specs.append(gen_batch_decode_module(*common))
                specs.append(gen_batch_prefill_module("fa2", *common, False))
                if args.fa3 and kv == q and _hopper_listed():
                    specs.append(gen_batch_prefill_module("fa3", *common, False))
    return specs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bfloat16", help=f"comma list of {sorted(_DTYPES)}")
    p.add_argument("--kv-dtypes", default="auto,float8_e4m3fn",
                   help=f"comma list of {sorted(_KV_DTYPES)} (auto = the model dtype)")
    p.add_argument("--head-dims", default="128", help="comma list, e.g. 64,128,256")
    p.add_argument("--fa3", action="store_true", help="also the fa3 paged-prefill kernels")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    args.kv_dtypes = args.kv_dtypes.split(",")
    args.head_dims = [int(h) for h in args.head_dims.split(",")]
    bad = (set(args.dtypes) - _DTYPES) | (set(args.kv_dtypes) - _KV_DTYPES)
    if bad:
        p.error(f"unknown dtype(s): {sorted(bad)}")
    # Must be set before flashinfer is imported: it fixes the cache directory's arch name then.
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")

    from flashinfer.jit import env as jit_env
    from flashinfer.jit.core import build_jit_specs

    specs = _specs(args)
    start = time.monotonic()
    build_jit_specs(specs, verbose=args.verbose)
    missing = [s.name for s in specs if not s.jit_library_path.exists()]
    for name in missing:
        print(f"prebuild_flashinfer: not built: {name}", file=sys.stderr)
    if missing:
        return 1
    for spec in specs:
        spec.aot_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, spec.aot_path)
    print(f"prebuild_flashinfer: {len(specs)} modules for {os.environ['FLASHINFER_CUDA_ARCH_LIST']}"
          f" in {jit_env.FLASHINFER_AOT_DIR} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
