"""W4A16 kernels on the GPU: accuracy, speed and a tile sweep (the CPU tests run the same kernels
in Triton's interpreter: tests/worker/test_w4a16_kernels.py).

    TRITON_INTERPRET=0 PYTHONPATH=... python3 tests/gpu/test_w4a16.py [--sweep] [--json F]
    [--skip-moe] [--skip-dense] [--rows 1 16 ...]                      # or make test-gpu

1. Dense (kernels/w4a16_gemm.py) on Qwen3-8B's projections (N, K), group 128 (asymmetric for
   qkv and down, symmetric for o and gate_up), M from 1 to 4,096, bf16 and fp16: max error
   against the fp32 product of the dequantized weight (quant/w4a16.reference_linear), a replayed
   CUDA graph equal to the eager output bit for bit (split-K counters reset), and in bf16 the
   time a call inside a CUDA graph of back-to-back calls over rotating weight copies (so decode
   sizes stream from HBM, not L2) beside bf16 F.linear the same way: µs, GB/s of weight + scale
   bytes, % of 4.8 TB/s. Act-order (perm, gidx) spot checks on one shape.
2. MoE (kernels/moe_w4a16.py) at Qwen3-30B-A3B's experts (E=128, H=2048, I=768, top-8), group
   128: error against fused_moe.moe_reference on the dequantized experts in fp32, graph time
   beside bf16 fused_moe_triton on the same (dequantized) experts, rotating routings.
--sweep times tile candidates per M bucket (dense: summed over the four projections; MoE: per
T) and prints replacement tables for w4a16_gemm.CONFIGS and moe_w4a16.choose_config.
Exit status 1 on any accuracy failure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
MOE_TOKENS = (1, 8, 64, 256, 1024, 4096)
E, H, INTER, TOP_K = 128, 2048, 768, 8
GROUP = 128
PEAK = 4.8e12  # H200 HBM3e bytes/s
L2_BYTES = 60 << 20
TOL = 1e-2  # max |err| / max |ref|: bf16 tiles and output rounding


def graph_us(calls: list[Callable[[], object]], reps: int) -> float:
    """µs a call: one CUDA graph of `reps` calls cycling through `calls`, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(3):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / reps)
    del graph
    return best


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(3 * L2_BYTES / nbytes))


def w4_bytes(w) -> int:  # noqa: ANN001
    return sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.zeros)
               if t is not None)


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def make_dense(n: int, k: int, symmetric: bool, gen: torch.Generator):  # noqa: ANN201
    from minisgl_worker.quant.w4a16 import dequantize, quantize

    w = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, GROUP, symmetric)
    return w, dequantize(w)


def as_dtype(w, dtype: torch.dtype):  # noqa: ANN001, ANN201
    zeros = w.zeros.to(dtype) if w.zeros is not None else None
    return replace(w, scales=w.scales.to(dtype), zeros=zeros)


def clone_w4(w):  # noqa: ANN001, ANN201
    return replace(w, qweight=w.qweight.clone(), scales=w.scales.clone(),
                   zeros=w.zeros.clone() if w.zeros is not None else None)


def check_dense(rows: tuple[int, ...], timing: bool) -> tuple[list[dict], list[str]]:
    from minisgl_worker.kernels.w4a16_gemm import config_for, w4a16_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    results, failures = [], []
    print(f"{'shape':>8} {'M':>5} {'dtype':>5} {'err':>8} {'w4 us':>8} {'bf16 us':>8} "
          f"{'speedup':>7} {'GB/s':>6} {'%4.8TB':>6}  config")
    for name, (n, k) in SHAPES.items():
        w32, wd = make_dense(n, k, name in ("qkv", "down"), gen)
        for dtype in (torch.bfloat16, torch.float16):
            w = as_dtype(w32, dtype)
            copies = [w] + [clone_w4(w) for _ in range(copies_for(w4_bytes(w)) - 1)]
            dense = [wd.to(dtype)] if timing and dtype == torch.bfloat16 else []
            if dense:
                dense += [dense[0].clone() for _ in range(copies_for(n * k * 2) - 1)]
            for m in rows:
                x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
                out = w4a16_linear(x, w)
                err = max_err(out, x.float() @ wd.t())
                graph_ok = graph_equal(lambda x=x, w=w: w4a16_linear(x, w), out)
                row = dict(shape=name, n=n, k=k, m=m, dtype=str(dtype), err=err,
                           graph_equal=graph_ok, config=repr(config_for(m)))
                line = f"{name:>8} {m:>5} {str(dtype)[6:]:>5} {err:>8.1e}"
                if dense:
                    reps = 40 if m <= 256 else 8
                    t4 = graph_us([lambda x=x, c=c: w4a16_linear(x, c) for c in copies], reps)
                    tb = graph_us([lambda x=x, d=d: F.linear(x, d) for d in dense], reps)
                    gbs = w4_bytes(w) / (t4 * 1e-6) / 1e9
                    row.update(w4_us=t4, bf16_us=tb, gb_per_s=gbs, pct_peak=gbs * 1e9 / PEAK)
                    line += (f" {t4:>8.1f} {tb:>8.1f} {tb / t4:>6.2f}x {gbs:>6.0f} "
                             f"{100 * gbs * 1e9 / PEAK:>5.0f}%  {row['config']}")
                ok = err < TOL and graph_ok
                print(line + ("" if ok else "  FAIL" + ("" if graph_ok else " (graph differs)")))
                if not ok:
                    failures.append(f"dense {name} m={m} {dtype}")
                results.append(row)
            del copies, dense
    failures += check_act_order(gen)
    failures += check_packed(gen)
    return results, failures


def graph_equal(call: Callable[[], torch.Tensor], eager: torch.Tensor) -> bool:
    """A captured call, replayed twice (counters must be back at 0), equals the eager output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    return torch.equal(out, eager)


def check_act_order(gen: torch.Generator) -> list[str]:
    """perm in-kernel (small M) and through index_select (large M); gidx (per-row groups)."""
    from minisgl_worker.kernels.w4a16_gemm import w4a16_linear
    from minisgl_worker.quant.w4a16 import quantize, reference_linear

    n, k = 4096, 4096
    perm = torch.randperm(k, device="cuda", generator=gen).to(torch.int32)
    w = as_dtype(quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, GROUP,
                          False, perm), torch.bfloat16)
    # the same groups, spelled out per canonical row (what a row-parallel shard carries)
    wg = replace(w, gidx=(torch.arange(k, device="cuda") // GROUP).to(torch.int32))
    failures = []
    for label, ww in (("perm", w), ("gidx", wg)):
        for m in (1, 16, 1024):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            err = max_err(w4a16_linear(x, ww), reference_linear(x.float(), ww).float())
            print(f"act-order {label} M={m}: err {err:.1e}" + ("" if err < TOL else "  FAIL"))
            if err >= TOL:
                failures.append(f"{label} m={m}")
    return failures


def packed_configs(m: int) -> list:  # noqa: ANN401
    """W4Config.packed_dequant variants (w4a16_packed.py's PTX) for an M: the decode tile
    (BLOCK_M 16, split-K) with x reordered and gathered, and a prefill tile."""
    from minisgl_worker.kernels.w4a16_gemm import W4Config

    if m <= 16:
        return [W4Config(False, 16, 64, 128, 4, 4, waves=2, packed_dequant=True),
                W4Config(False, 16, 128, 256, 4, 3, waves=2, x_permuted=False,
                         packed_dequant=True)]
    return [W4Config(False, 64, 128, 128, 4, 4, waves=1, packed_dequant=True),
            W4Config(False, 128, 128, 64, 8, 4, packed_dequant=True)]


def check_packed(gen: torch.Generator) -> list[str]:
    """The packed dequantization on the GPU (its PTX runs nowhere else): bf16 and fp16, sym
    (o) and asym (qkv), decode and prefill tiles, act-order perm and gidx; graph replay."""
    from minisgl_worker.kernels.w4a16_gemm import w4a16_linear
    from minisgl_worker.quant.w4a16 import quantize, reference_linear

    failures = []
    k = 4096
    perm = torch.randperm(k, device="cuda", generator=gen).to(torch.int32)
    base = {"qkv": make_dense(6144, k, False, gen)[0], "o": make_dense(4096, k, True, gen)[0],
            "perm": quantize(torch.randn(4096, k, device="cuda", generator=gen) * 0.02, GROUP,
                             False, perm)}
    base["gidx"] = replace(base["perm"],
                           gidx=(torch.arange(k, device="cuda") // GROUP).to(torch.int32))
    for dtype in (torch.bfloat16, torch.float16):
        for label, w32 in base.items():
            w = as_dtype(w32, dtype)
            for m in (1, 5, 16, 64, 300):
                x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
                ref = reference_linear(x.float(), w).float()
                for cfg in packed_configs(m):
                    out = w4a16_linear(x, w, cfg)
                    err = max_err(out, ref)
                    ok = err < TOL and graph_equal(lambda x=x, w=w, c=cfg: w4a16_linear(x, w, c),
                                                   out)
                    if not ok:
                        print(f"packed {label} {dtype} M={m} {cfg}: err {err:.1e}  FAIL")
                        failures.append(f"packed {label} m={m} {dtype}")
    print("packed dequantization: " + ("OK" if not failures else f"{len(failures)} FAILED"))
    return failures


def sweep_candidates(m: int) -> list:  # noqa: ANN401
    from minisgl_worker.kernels.w4a16_gemm import W4Config

    cands = []
    if m <= 4:  # the GEMV runs a row a program
        for bn, bk, warps, stages, waves in [
                (32, 128, 4, 1, 4), (64, 128, 4, 1, 4), (64, 128, 4, 1, 8), (64, 256, 4, 1, 4),
                (128, 128, 4, 1, 4), (128, 64, 4, 1, 4), (64, 64, 2, 1, 8), (128, 128, 8, 1, 2),
                (64, 128, 4, 1, 0), (32, 256, 4, 1, 8), (256, 64, 4, 1, 4), (64, 512, 8, 1, 4)]:
            cands.append(W4Config(True, 1, bn, bk, warps, stages, waves=waves))
    # GEMM (w4a16_mma.py): (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split-K waves, x_permuted).
    # BLOCK_N is wgmma's M side (64 a warpgroup), BLOCK_M its N side; ~5 a bucket so that a sweep
    # of 16..4096 rows compiles ~30 kernels and runs in about two minutes.
    if 2 <= m <= 32:
        bm = max(16, 1 << (m - 1).bit_length())
        grid = [(bm, 64, 128, 4, 4, 2, True), (bm, 128, 128, 4, 4, 2, True),
                (bm, 64, 256, 4, 3, 2, True), (bm, 64, 128, 4, 4, 4, True),
                (bm, 64, 128, 4, 4, 2, False)]
    elif m <= 256:
        grid = [(64, 128, 128, 4, 4, 1, True), (64, 128, 64, 4, 4, 1, True),
                (128, 128, 64, 8, 4, 0, True), (128, 256, 64, 8, 3, 0, True),
                (128, 128, 128, 8, 3, 0, True)]
    else:
        grid = [(128, 128, 64, 8, 4, 0, True), (128, 256, 64, 8, 3, 0, True),
                (256, 128, 64, 8, 3, 0, True), (128, 128, 128, 8, 3, 0, True),
                (64, 256, 64, 4, 4, 0, True)]
    if m >= 2:
        for bm, bn, bk, warps, stages, waves, xp in grid:
            for packed in (False, True):
                cands.append(W4Config(False, min(bm, max(16, 1 << (m - 1).bit_length())), bn,
                                      bk, warps, stages, waves=waves, x_permuted=xp,
                                      packed_dequant=packed))
    if m <= 4:  # the packed GEMM as the decode kernel (Marlin's way: rows padded to 16)
        for bn, bk, warps, stages, waves, xp in [
                (64, 128, 4, 4, 2, True), (64, 128, 4, 4, 4, False), (128, 128, 4, 4, 2, False),
                (64, 256, 4, 3, 4, False), (128, 256, 4, 3, 2, False), (64, 128, 4, 4, 8, False)]:
            cands.append(W4Config(False, 16, bn, bk, warps, stages, waves=waves, x_permuted=xp,
                                  packed_dequant=True))
    return cands


def sweep_dense(rows: tuple[int, ...]) -> list[dict]:
    from minisgl_worker.kernels.w4a16_gemm import config_for, w4a16_linear
    from minisgl_worker.quant.w4a16 import reference_linear

    gen = torch.Generator(device="cuda").manual_seed(1)
    ws = {name: as_dtype(make_dense(n, k, name in ("qkv", "down"), gen)[0], torch.bfloat16)
          for name, (n, k) in SHAPES.items()}
    copies = {name: [w] + [clone_w4(w) for _ in range(copies_for(w4_bytes(w)) - 1)]
              for name, w in ws.items()}
    table = []
    for m in rows:
        xs = {name: torch.randn(m, k, device="cuda", generator=gen).bfloat16()
              for name, (_, k) in SHAPES.items()}

        reps = 20 if m <= 256 else 4
        refs = {nm: reference_linear(xs[nm].float(), ws[nm]).float() for nm in SHAPES}

        def layer_us(cfg, xs=xs, reps=reps, refs=refs) -> float:  # noqa: ANN001
            for nm in SHAPES:  # a candidate that computes wrong is no candidate
                err = max_err(w4a16_linear(xs[nm], ws[nm], cfg), refs[nm])
                if err >= TOL:
                    raise ValueError(f"{nm}: error {err:.1e}")
            return sum(graph_us([lambda x=xs[nm], c=c: w4a16_linear(x, c, cfg)
                                 for c in copies[nm]], reps) for nm in SHAPES)

        default = layer_us(config_for(m))
        timed = []
        for cfg in sweep_candidates(m):
            try:
                timed.append((layer_us(cfg), cfg))
            except Exception as exc:  # e.g. out of shared memory, or wrong (then say so)
                print(f"  skip {cfg}: {type(exc).__name__}"
                      + (f" {exc}  FAIL" if isinstance(exc, ValueError) else ""))
        timed.sort(key=lambda t: t[0])
        print(f"M={m}: default {default:.1f} us a layer (4 projections)")
        for us, cfg in timed[:3]:
            print(f"    {us:.1f} us ({default / us:.2f}x)  {cfg}")
        for packed in (False, True):  # the packed dequantization against the current kernels
            best = next(((us, c) for us, c in timed if c.packed_dequant == packed), None)
            if best:
                print(f"    best {'packed' if packed else 'plain'}: {best[0]:.1f} us  {best[1]}")
        if timed:
            table.append(dict(m=m, default_us=default, best_us=timed[0][0],
                              best=repr(timed[0][1] if timed[0][0] < default else config_for(m))))
    print("CONFIGS = [")
    for row in table:
        print(f"    ({row['m']}, {row['best']}),")
    print("]")
    return table


def check_moe(tokens: tuple[int, ...], timing: bool,
              sweep: tuple[int, ...]) -> tuple[list[dict], list[str]]:
    from minisgl_worker.kernels.fused_moe import fused_moe_triton, moe_reference, route
    from minisgl_worker.kernels.moe_w4a16 import choose_config, fused_moe_w4a16
    from minisgl_worker.quant.w4a16 import dequantize_experts, quantize_experts

    torch.manual_seed(0)
    w13 = quantize_experts(torch.randn(E, 2 * INTER, H, device="cuda") / H**0.5, GROUP, False)
    w2 = quantize_experts(torch.randn(E, H, INTER, device="cuda") / INTER**0.5, GROUP, True)
    d13, d2 = dequantize_experts(w13), dequantize_experts(w2)
    b13, b2 = as_dtype(w13, torch.bfloat16), as_dtype(w2, torch.bfloat16)
    bf13, bf2 = d13.bfloat16(), d2.bfloat16()
    expert_bytes = (w4_bytes(w13) + w4_bytes(w2)) / E
    results, failures = [], []
    print(f"{'T':>5} {'err':>8} {'w4 us':>8} {'bf16 us':>8} {'speedup':>7} {'GB/s':>6}  config")
    for t in tokens:
        sets = []
        for _ in range(8 if t <= 64 else 1):  # rotating routings: decode reads from HBM
            x = torch.randn(t, H, device="cuda").bfloat16()
            wts, ids = route(torch.randn(t, E, device="cuda"), TOP_K, True)
            sets.append((x, ids, wts.bfloat16()))
        x, ids, wts = sets[0]
        out = fused_moe_w4a16(x, b13, b2, ids, wts)
        ref = moe_reference(x.float(), d13, d2, ids, wts.float())
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ok = err < TOL and graph_equal(
            lambda s=sets[0]: fused_moe_w4a16(s[0], b13, b2, s[1], s[2]), out)
        row = dict(tokens=t, err=err, config=repr(choose_config(t)))
        line = f"{t:>5} {err:>8.1e}"
        if timing:
            reps = 16 if t <= 256 else 4
            t4 = graph_us([lambda s=s: fused_moe_w4a16(s[0], b13, b2, s[1], s[2]) for s in sets],
                          reps)
            tb = graph_us([lambda s=s: fused_moe_triton(s[0], bf13, bf2, s[1], s[2])
                           for s in sets], reps)
            touched = sum(int(s[1].unique().numel()) for s in sets) / len(sets)
            gbs = touched * expert_bytes / (t4 * 1e-6) / 1e9
            row.update(w4_us=t4, bf16_us=tb, gb_per_s=gbs)
            line += f" {t4:>8.1f} {tb:>8.1f} {tb / t4:>6.2f}x {gbs:>6.0f}  {row['config']}"
            if t in sweep:
                row["sweep"] = sweep_moe(t, sets, b13, b2, t4)
        print(line + ("" if ok else "  FAIL"))
        if not ok:
            failures.append(f"moe T={t}")
        results.append(row)
    return results, failures


def sweep_moe(t: int, sets: list, w13, w2, default_us: float) -> list[dict]:  # noqa: ANN001
    from minisgl_worker.kernels.fused_moe import GemmTile, MoeConfig
    from minisgl_worker.kernels.moe_w4a16 import choose_config, fused_moe_w4a16

    base = choose_config(t)
    bms = [16] if t <= 64 else [32, 64] if t <= 1024 else [64, 128]
    tiles = ([(32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 4),
              (128, 128, 4, 3)] if t <= 64 else
             [(64, 128, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4)])
    cands = list(dict.fromkeys(
        [MoeConfig(bm, GemmTile(*tl), base.down) for bm in bms for tl in tiles]
        + [MoeConfig(bm, base.gate_up, GemmTile(*tl)) for bm in bms for tl in tiles]))
    res = []
    for cfg in cands:
        try:
            us = graph_us([lambda s=s, c=cfg: fused_moe_w4a16(s[0], w13, w2, s[1], s[2], c)
                           for s in sets], 8 if t <= 256 else 2)
        except Exception as exc:
            print(f"    skip {cfg}: {type(exc).__name__}")
            continue
        res.append(dict(config=repr(cfg), us=us))
    res.sort(key=lambda r: r["us"])
    for r in res[:3]:
        print(f"    {r['us']:.1f} us ({default_us / r['us']:.2f}x default)  {r['config']}")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--tokens", type=int, nargs="+", default=list(MOE_TOKENS))
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 4096],
                   help="M buckets the dense sweep tunes (each bucket's best ends the table)")
    p.add_argument("--sweep-tokens", type=int, nargs="+", default=[1, 64, 256, 4096],
                   help="T values the MoE sweep tunes")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--skip-dense", action="store_true")
    p.add_argument("--skip-moe", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("test_w4a16: needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references stay fp32
    print(torch.cuda.get_device_name(), f"{torch.cuda.get_device_properties(0).multi_processor_count}"
          " SMs")
    report: dict = {"device": torch.cuda.get_device_name()}
    failures: list[str] = []
    if not args.skip_dense:
        report["dense"], fails = check_dense(tuple(args.rows), not args.no_timing)
        failures += fails
        if args.sweep:
            report["dense_sweep"] = sweep_dense(tuple(args.sweep_rows))
    if not args.skip_moe:
        report["moe"], fails = check_moe(tuple(args.tokens), not args.no_timing,
                                         tuple(args.sweep_tokens) if args.sweep else ())
        failures += fails
    print("accuracy " + ("OK" if not failures else f"FAILED: {', '.join(failures)}"))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if not failures else 1


@pytest.mark.parametrize("part", ["dense", "moe"])
def test_w4a16(part: str) -> None:
    """Accuracy and graph-safety of every path, with the timings printed."""
    assert main(["--skip-moe" if part == "dense" else "--skip-dense"]) == 0


if __name__ == "__main__":
    sys.exit(main())
