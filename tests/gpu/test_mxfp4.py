"""GPU check of the MXFP4 expert kernels (kernels/moe_mxfp4.py) at gpt-oss-20b shapes (E=32, top-4,
H=I=2880): accuracy, then speed against the MXFP4 roofline and beside bf16 `fused_moe`.

    TRITON_INTERPRET=0 PYTHONPATH=... python3 tests/gpu/test_mxfp4.py [--sweep] [--json F]
    (or as a pytest test: make test-gpu)

For each batch size T (default 1 4 16 64 256 1024 4096):
- error of the kernels (in-register PTX upcast, and the float upcast) against the reference
  (the experts dequantized exactly into fp32, fp32 products), relative Frobenius; both must be
  within --tol (bf16 activations and intermediate rounding: ~3e-3 expected);
- CUDA-graph replay time (L2 flushed before each; output equal to eager bit for bit), GB/s of the
  MXFP4 bytes the batch reads (the distinct experts touched: 4.25 bits a weight, scales included)
  and % of the H200's 4.8 TB/s (and of the copy bandwidth measured here);
- the bf16 `fused_moe` with biases on the same routing, its time and the MXFP4 speed-up.
--sweep times tile candidates per T (eager, each GEMM tuned with the other at its default) and
prints the best three, to re-tune `moe_mxfp4.choose_config`. Exit status 1 on an accuracy miss.
About 2-3 minutes on an H200 with --sweep.

--decode: the decode path instead (moe_mxfp4_gemv.py, the GEMVs `mxfp4_moe` takes up to
GEMV_MAX_PAIRS pairs) at T in 1 2 4 8 16 32 64: its error against the reference, its graph time
beside the grouped GEMM's and bf16's, GB/s of the MXFP4 bytes; with --sweep a few GEMV tiles per
T (best three printed, to re-tune `choose_gemv_config` and GEMV_MAX_PAIRS). About 1-2 minutes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
E, H, INTER, TOP_K = 32, 2880, 2880, 4
PEAK = 4.8e12  # H200 HBM3e, bytes/s (datasheet)


def _paths() -> None:
    for p in (ROOT, ROOT / "tests"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


def _experts(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random gpt-oss-like experts, quantized on the GPU: packed MXFP4, and bf16 copies of the
    same dequantized values for the bf16 comparison."""
    from minisgl_worker.quant import mxfp4

    gen = torch.Generator(device="cuda").manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in (("w13", (E, 2 * INTER, H)), ("w2", (E, H, INTER))):
        packed = torch.empty(*shape[:2], shape[2] // 2, dtype=torch.uint8, device="cuda")
        scales = torch.empty(*shape[:2], shape[2] // 32, dtype=torch.uint8, device="cuda")
        deq = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        for e in range(E):  # one expert at a time: the quantizer's temporaries stay small
            blocks, scales[e] = mxfp4.quantize(
                torch.randn(shape[1:], device="cuda", generator=gen) * 0.02)
            packed[e] = blocks.view(shape[1], -1)
            deq[e] = mxfp4.dequantize(blocks, scales[e], torch.bfloat16)
        out[name], out[name + "_scale"], out[name + "_bf16"] = packed, scales, deq
    out["w13_bias"] = torch.randn(E, 2 * INTER, device="cuda", generator=gen).bfloat16() * 0.1
    out["w2_bias"] = torch.randn(E, H, device="cuda", generator=gen).bfloat16() * 0.1
    return out


def mxfp4_bytes(ids: torch.Tensor) -> int:
    """Bytes of the experts the batch touches: 3 * H * I weights an expert at 4.25 bits."""
    return int(torch.unique(ids).numel()) * 3 * H * INTER * 17 // 32


def sweep_configs(t: int) -> list:
    from minisgl_worker.kernels.fused_moe import GemmTile, MoeConfig
    from minisgl_worker.kernels.moe_mxfp4 import choose_config

    block_ms = [16] if t <= 64 else [16, 32] if t <= 256 else [32, 64] if t <= 1024 else [64, 128]
    if t <= 128:  # memory-bound: swap_ab tiles, narrow, deep K
        tiles = [GemmTile(n, k, w, s, swap_ab=True) for n, k, w, s in (
            (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3),
            (128, 128, 8, 3), (64, 256, 4, 4))] + [GemmTile(32, 128, 4, 4),
                                                     GemmTile(32, 256, 4, 3)]
    else:
        tiles = [GemmTile(n, k, w, s) for n, k, w, s in (
            (64, 64, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (256, 64, 8, 3),
            (128, 64, 8, 4))]
    base = choose_config(t)
    return list(dict.fromkeys(
        [MoeConfig(bm, u, base.down) for bm, u in itertools.product(block_ms, tiles)]
        + [MoeConfig(bm, base.gate_up, d) for bm, d in itertools.product(block_ms, tiles)]))


def sweep(t: int, call: Callable[..., torch.Tensor], timer: Callable, iters: int,
          default_ms: float) -> list[dict]:
    from gpu.test_moe import rel_err

    results, default_out = [], call()
    for cfg in sweep_configs(t):
        try:
            err = rel_err(call(config=cfg), default_out)
            ms = timer(lambda cfg=cfg: call(config=cfg), iters)
        except Exception as exc:  # a tile needing more shared memory or registers than exist
            print(f"    skip {cfg}: {type(exc).__name__}")
            continue
        if err > 1e-2:
            print(f"    WRONG ({err:.1e} from the default) {cfg}")
            continue
        results.append(dict(config=repr(cfg), ms=ms))
    results.sort(key=lambda r: r["ms"])
    for r in results[:3]:
        print(f"    {r['ms'] * 1e3:.1f} us ({default_ms / r['ms']:.2f}x default)  {r['config']}")
    return results


def gemv_configs() -> list:
    from minisgl_worker.kernels.moe_mxfp4 import GemvConfig, GemvTile

    tiles = [GemvTile(n, k, w) for n, k, w in (
        (16, 256, 4), (16, 128, 4), (32, 256, 4), (32, 128, 4), (16, 512, 4), (32, 256, 8),
        (64, 128, 8), (8, 256, 2))]
    return [GemvConfig(p, t, t) for p in (1, 2) for t in tiles]


def decode_main(args: argparse.Namespace) -> int:
    from minisgl_worker.kernels.clamped_swiglu import ClampedSwiGLU
    from minisgl_worker.kernels.fused_moe import fused_moe_triton, moe_reference
    from minisgl_worker.kernels.moe_mxfp4 import (
        choose_gemv_config,
        mxfp4_moe_gemv,
        mxfp4_moe_triton,
    )

    from gpu.test_moe import Timer, graph_time, rel_err

    torch.manual_seed(0)
    w = _experts()
    act = ClampedSwiGLU(1.702, 7.0)
    bias = dict(w13_bias=w["w13_bias"], w2_bias=w["w2_bias"], activation=act)
    timer, rows, ok = Timer(), [], True
    tokens = args.tokens if args.tokens_given else [1, 2, 4, 8, 16, 32, 64]
    print(f"decode path (GEMVs) vs grouped GEMM vs bf16; E={E} top-{TOP_K} H={H} I={INTER}")
    for t in tokens:
        x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
        top, ids = torch.topk(torch.randn(t, E, device="cuda"), TOP_K, dim=-1)
        weights = torch.softmax(top, -1).bfloat16()
        ref = moe_reference(x.float(), w["w13_bf16"].float(), w["w2_bf16"].float(), ids,
                            weights.float(), w13_bias=w["w13_bias"].float(),
                            w2_bias=w["w2_bias"].float(), activation=act)
        args_ = (x, w["w13"], w["w2"], ids, weights, w["w13_scale"], w["w2_scale"])

        def gemv(config: object = None, a: tuple = args_) -> torch.Tensor:
            return mxfp4_moe_gemv(*a, config=config, **bias)  # type: ignore[arg-type]

        def gemm(a: tuple = args_) -> torch.Tensor:
            return mxfp4_moe_triton(*a, **bias)  # type: ignore[arg-type]

        def bf16(x: torch.Tensor = x, ids: torch.Tensor = ids,
                 weights: torch.Tensor = weights) -> torch.Tensor:
            return fused_moe_triton(x, w["w13_bf16"], w["w2_bf16"], ids, weights, **bias)

        err = rel_err(gemv(), ref)
        ok &= err < args.tol
        ms, equal = graph_time(gemv, gemv(), timer, args.iters)
        ok &= equal
        gemm_ms, _ = graph_time(gemm, gemm(), timer, args.iters)
        bf16_ms, _ = graph_time(bf16, bf16(), timer, args.iters)
        nbytes = mxfp4_bytes(ids)
        gbs = nbytes / (ms * 1e-3) / 1e9
        row: dict[str, object] = dict(tokens=t, err=err, us=ms * 1e3, gb_s=gbs,
                                      gemm_us=gemm_ms * 1e3, bf16_us=bf16_ms * 1e3,
                                      config=repr(choose_gemv_config(t * TOP_K)))
        print(f"T={t:3d}  gemv {ms * 1e3:7.1f} us {gbs:6.0f} GB/s ({100 * gbs * 1e9 / PEAK:4.1f}%)"
              f"  gemm {gemm_ms * 1e3:7.1f} us  bf16 {bf16_ms * 1e3:7.1f} us  err={err:.1e}"
              f"  graph={equal}")
        if args.sweep:
            results = []
            for cfg in gemv_configs():
                try:
                    e = rel_err(gemv(cfg), ref)
                    c_ms = timer(lambda cfg=cfg: gemv(cfg), max(10, args.iters // 3))
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile
                    print(f"    skip {cfg}: {type(exc).__name__}")
                    continue
                if e > args.tol:
                    print(f"    WRONG ({e:.1e}) {cfg}")
                    ok = False
                    continue
                results.append(dict(config=repr(cfg), ms=c_ms))
            results.sort(key=lambda r: r["ms"])
            for r in results[:3]:
                print(f"    {r['ms'] * 1e3:.1f} us (eager)  {r['config']}")
            row["sweep"] = results
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows=rows), indent=1))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    _paths()
    from minisgl_worker.kernels.clamped_swiglu import ClampedSwiGLU
    from minisgl_worker.kernels.fused_moe import fused_moe_triton, moe_reference
    from minisgl_worker.kernels.moe_mxfp4 import mxfp4_moe_triton

    from bench.common.roofline import measure_hbm_bandwidth
    from gpu.test_moe import Timer, graph_time, rel_err

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 4096])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--tol", type=float, default=1e-2)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--decode", action="store_true", help="the decode path (GEMVs), T 1..64")
    args = p.parse_args(argv)
    args.tokens_given = any(a.startswith("--tokens") for a in (argv or sys.argv[1:]))
    if args.decode:
        return decode_main(args)

    torch.manual_seed(0)
    w = _experts()
    act = ClampedSwiGLU(1.702, 7.0)
    bias = dict(w13_bias=w["w13_bias"], w2_bias=w["w2_bias"], activation=act)
    copy_bw = measure_hbm_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; gpt-oss-20b experts E={E} top-{TOP_K} "
          f"H={H} I={INTER}")
    timer, rows, ok = Timer(), [], True
    for t in args.tokens:
        x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(t, E, device="cuda")
        top, ids = torch.topk(logits, TOP_K, dim=-1)
        weights = torch.softmax(top, -1).bfloat16()

        def mx(asm: bool | None = None, x: torch.Tensor = x, ids: torch.Tensor = ids,
               weights: torch.Tensor = weights, **kw: object) -> torch.Tensor:
            return mxfp4_moe_triton(x, w["w13"], w["w2"], ids, weights, w["w13_scale"],
                                    w["w2_scale"], asm=asm, **bias, **kw)  # type: ignore[arg-type]

        ref = moe_reference(x.float(), w["w13_bf16"].float(), w["w2_bf16"].float(), ids,
                            weights.float(), w13_bias=w["w13_bias"].float(),
                            w2_bias=w["w2_bias"].float(), activation=act)
        row: dict[str, object] = dict(tokens=t)
        for name, asm in (("asm", True), ("float", False)):
            try:
                err = rel_err(mx(asm), ref)
            except Exception as exc:  # noqa: BLE001 - report and go on with the other variant
                print(f"T={t} {name} upcast FAILED: {type(exc).__name__}: {exc}")
                ok = False
                continue
            row[f"err_{name}"] = err
            ok &= err < args.tol
        asm = "err_asm" in row  # time the PTX upcast unless it failed (then the float one)
        out = mx(asm)
        ms, equal = graph_time(lambda asm=asm: mx(asm), out, timer, args.iters)
        ok &= equal
        nbytes = mxfp4_bytes(ids)

        def bf16(x: torch.Tensor = x, ids: torch.Tensor = ids,
                 weights: torch.Tensor = weights) -> torch.Tensor:
            return fused_moe_triton(x, w["w13_bf16"], w["w2_bf16"], ids, weights, **bias)

        bf16_ms, _ = graph_time(bf16, bf16(), timer, args.iters)
        gbs = nbytes / (ms * 1e-3) / 1e9
        row.update(us=ms * 1e3, gb_s=gbs, pct_peak=100 * gbs * 1e9 / PEAK,
                   pct_copy=100 * gbs * 1e9 / copy_bw, bf16_us=bf16_ms * 1e3,
                   speedup=bf16_ms / ms, graph_equal=equal, mxfp4_mb=nbytes / 1e6)
        errs = " ".join(f"{k}={v:.1e}" for k, v in row.items() if str(k).startswith("err"))
        print(f"T={t:5d}  {ms * 1e3:8.1f} us  {gbs:7.0f} GB/s  {row['pct_peak']:5.1f}% of 4.8 TB/s"
              f"  bf16 {bf16_ms * 1e3:8.1f} us  x{bf16_ms / ms:4.2f}  {errs}  graph={equal}")
        if args.sweep:
            row["sweep"] = sweep(t, lambda asm=asm, **kw: mx(asm, **kw), timer, max(10, args.iters // 3),
                                 ms)
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(copy_bw=copy_bw, rows=rows), indent=1))
    return 0 if ok else 1


def test_mxfp4_moe() -> None:
    """MXFP4 experts within 1e-2 of the fp32 reference, both upcasts; graph replay equal."""
    assert main(["--tokens", "1", "16", "256", "4096", "--iters", "20"]) == 0


def test_mxfp4_decode_path() -> None:
    """The decode GEMVs within 1e-2 of the fp32 reference; graph replay equal."""
    assert main(["--decode", "--tokens", "1", "4", "16", "--iters", "20"]) == 0


if __name__ == "__main__":
    sys.exit(main())
