"""Decode-batch projections (64-256 rows): a Triton GEMM of ours (below: PDL + an L2 prefetch of
the weights + deterministic split-K) against cuBLAS (F.linear), alone and inside a layer's chain
of kernels. An experiment that was not adopted (docs/benchmarks.md, eleventh session): at these
shapes cuBLAS is as fast or faster; the kernel lives here so the figures can be reproduced.

    source bench/gpu_env.sh && python bench/gpu_bench_decode_gemm.py [--models qwen3-0.6b,qwen3-8b]

1. Alone: per projection (qkv, o, gate_up, down) and row count, cuBLAS and every config of a small
   grid, each timed as a CUDA graph cycling through >= 400 MB of weight copies (none stays in L2).
2. Chain: a decode layer's kernels minus attention, for `layers` distinct layers in one graph:
   residual-add + RMSNorm -> qkv -> per-head RMSNorm of q (a small kernel standing where attention
   and its merge are) -> o -> residual-add + RMSNorm -> gate_up -> SiLU-and-mul -> down, with the
   products from cuBLAS, or ours at each shape's fastest config with and without the prefetch.
Every config's output is checked against an fp32 product (max |y - ref| / max |ref|); one worse
than 2x cuBLAS's error plus a bf16 ulp makes the exit status 1. One JSON line per figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "services" / "worker"))
sys.path.insert(0, str(ROOT / "bench"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gpu_timing import graph_replay_ms  # noqa: E402
from minisgl_worker.kernels import fused_ops, pdl  # noqa: E402
from minisgl_worker.kernels.pdl import begin as _pdl_begin  # noqa: E402
from minisgl_worker.kernels.pdl import release as _pdl_release  # noqa: E402
from minisgl_worker.kernels.pdl import wait as _pdl_wait  # noqa: E402

# name -> (hidden, intermediate, q heads, kv heads, head_dim, layers)
MODELS = {"qwen3-0.6b": (1024, 3072, 16, 8, 128, 28), "qwen3-8b": (4096, 12288, 32, 8, 128, 36)}
DEV, DTYPE = "cuda", torch.bfloat16
EPS = 1e-6

Config = tuple[int, int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages


@triton.jit
def _prefetch_rows_l2(row_ptrs, nbytes):
    """One bulk L2 prefetch per row pointer (nbytes each, 16-byte aligned multiples)."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;",
                              "=r,l,r", [row_ptrs, nbytes], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, m, n, k, stride_a, stride_b, stride_c, stride_split,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr = False):
    """c[m, n] = sum_k a[m, k] * b[n, k] over this program's K range (all of K when SPLIT_K is
    1, else slice pid_k of c's [SPLIT_K, M, N] fp32 partials). Programs walk the M tiles of one
    N tile first, so a weight slab comes from memory once and from L2 for the other M tiles."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(n, BLOCK_N)
    pid_m = pid % tiles_m
    pid_n = (pid // tiles_m) % tiles_n
    pid_k = pid // (tiles_m * tiles_n)
    k_len = k // SPLIT_K
    k0 = pid_k * k_len
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    b_rows = b_ptr + tl.minimum(cols, n - 1).to(tl.int64) * stride_b + k0
    if PREFETCH:
        _pdl_release(USE_PDL)
        if pid_m == 0:  # one program of each weight slab asks for it
            _prefetch_rows_l2(b_rows, tl.full([BLOCK_N], 2, tl.int32) * k_len)
        _pdl_wait(USE_PDL)
    else:
        _pdl_begin(USE_PDL)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_a + (k0 + ks)[None, :]
    b_ptrs = b_rows[None, :] + ks[:, None]
    a_mask = rows[:, None] < m
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, k_len, BLOCK_K):
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b = tl.load(b_ptrs)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    mask = a_mask & (cols[None, :] < n)
    c_ptrs = (c_ptr + pid_k.to(tl.int64) * stride_split + rows[:, None].to(tl.int64) * stride_c
              + cols[None, :])
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(p_ptr, c_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    _pdl_begin(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def usable(a: torch.Tensor, b: torch.Tensor, config: Config) -> bool:
    block_k, split_k = config[2], config[3]
    return (a.stride(-1) == 1 and b.stride(-1) == 1 and b.is_contiguous()
            and a.shape[1] % (block_k * split_k) == 0)


def gemm(a: torch.Tensor, b: torch.Tensor, config: Config, prefetch: bool = True) -> torch.Tensor:
    """a [M, K] (rows may be strided) @ b[N, K].T -> [M, N] in a's dtype."""
    m, k = a.shape
    n = b.shape[0]
    block_m, block_n, block_k, split_k, warps, stages = config
    assert usable(a, b, config), (a.shape, b.shape, config)
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    opts = pdl.options(a)
    out = c if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32,
                                             device=a.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n) * split_k,)
    _gemm_kernel[grid](a, b, out, m, n, k, a.stride(0), b.stride(0), n, m * n,
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                       PREFETCH=prefetch and opts["USE_PDL"], num_warps=warps,
                       num_stages=stages, **opts)
    if split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](out, c, m * n, SPLIT_K=split_k,
                                                          BLOCK=block, num_warps=4, **opts)
    return c


def shapes(model: str) -> dict[str, tuple[int, int]]:
    h, i, hq, hkv, d, _ = MODELS[model]
    return {"qkv": ((hq + 2 * hkv) * d, h), "o": (h, hq * d), "gate_up": (2 * i, h),
            "down": (h, i)}


def grid() -> list[Config]:
    out = []
    for bm, bn, bk, split in itertools.product((64, 128), (64, 128), (64, 128), (1, 2, 4)):
        for warps in ((4,) if bm == 64 else (4, 8)):
            out.append((bm, bn, bk, split, warps, 3 if bk == 128 else 4))
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def alone(model: str, rows: list[int], repeats: int, emit: Callable[[dict], None]
          ) -> tuple[dict[tuple[str, int], Config], bool]:
    best: dict[tuple[str, int], Config] = {}
    ok = True
    for kind, (n, k) in shapes(model).items():
        copies = max(2, -(-400_000_000 // (n * k * 2)))
        weights = [torch.randn(n, k, device=DEV, dtype=DTYPE) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=DEV, dtype=DTYPE)
            ref = x.float() @ weights[0].float().T
            err_cublas = rel_err(F.linear(x, weights[0]), ref)
            us = {}
            ms = graph_replay_ms(lambda x=x, ws=weights: [F.linear(x, w) for w in ws], repeats)
            us["cublas"] = ms * 1000 / copies
            for cfg in grid():
                if not usable(x, weights[0], cfg):
                    continue
                try:
                    err = rel_err(gemm(x, weights[0], cfg), ref)
                    ms = graph_replay_ms(lambda c=cfg, x=x, ws=weights: [gemm(x, w, c) for w in ws],
                                     repeats)
                except Exception as exc:  # e.g. shared memory over the limit
                    emit({"model": model, "kind": kind, "m": m, "config": cfg,
                          "error": str(exc)[:120]})
                    continue
                if err > 2 * err_cublas + 2 ** -8:
                    ok = False
                    emit({"model": model, "kind": kind, "m": m, "config": cfg,
                          "bad_error": err, "cublas_error": err_cublas})
                us[cfg] = ms * 1000 / copies
            fastest = min((c for c in us if c != "cublas"), key=lambda c: us[c])
            best[(kind, m)] = fastest  # type: ignore[assignment]
            gbps = n * k * 2 / 1e3
            emit({"model": model, "kind": kind, "m": m, "cublas_us": round(us["cublas"], 2),
                  "ours_us": round(us[fastest], 2), "config": fastest,
                  "cublas_tbps": round(gbps / us["cublas"] / 1e3, 2),
                  "ours_tbps": round(gbps / us[fastest] / 1e3, 2),
                  "top5": sorted(((round(v, 2), str(c)) for c, v in us.items()
                                  if c != "cublas"))[:5]})
        weights.clear()
        torch.cuda.empty_cache()
    return best, ok


def chain(model: str, rows: list[int], best: dict[tuple[str, int], Config],
          repeats: int, emit: Callable[[dict], None]) -> None:
    layers = MODELS[model][5]
    w = [{kind: torch.randn(n, k, device=DEV, dtype=DTYPE) * 0.02
          for kind, (n, k) in shapes(model).items()} for _ in range(layers)]
    for m in rows:
        emit(chain_rows(model, m, w, best, repeats))


def chain_rows(model: str, m: int, w: list[dict[str, torch.Tensor]],
               best: dict[tuple[str, int], Config], repeats: int = 10) -> dict:
    h, _, hq, _, d, layers = MODELS[model]
    ln = torch.ones(h, device=DEV, dtype=DTYPE)
    qn = torch.ones(d, device=DEV, dtype=DTYPE)
    x0 = torch.randn(m, h, device=DEV, dtype=DTYPE)
    res = torch.zeros(m, h, device=DEV, dtype=DTYPE)

    def run(prod: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]) -> torch.Tensor:
        res.zero_()  # the norms add into it in place: every run starts from the same state
        x = x0
        for lw in w:
            a = fused_ops.rmsnorm(x, ln, EPS, residual=res)
            qkv = prod(a, lw["qkv"], "qkv")
            att = fused_ops.rmsnorm(qkv[:, : hq * d].view(m, hq, d), qn, EPS).view(m, hq * d)
            o = prod(att, lw["o"], "o")
            a = fused_ops.rmsnorm(o, ln, EPS, residual=res)
            act = fused_ops.silu_and_mul(prod(a, lw["gate_up"], "gate_up"))
            x = prod(act, lw["down"], "down")
        return x

    variants = {
        "cublas": lambda a, wt, kind: F.linear(a, wt),
        "ours+prefetch": lambda a, wt, kind: gemm(a, wt, best[(kind, m)]),
        "ours": lambda a, wt, kind: gemm(a, wt, best[(kind, m)], prefetch=False),
    }
    ref = run(variants["cublas"]).float()
    out = {"model": model, "chain_m": m, "layers": layers}
    for name, prod in variants.items():
        out[f"{name}_err"] = rel_err(run(prod), ref) if name != "cublas" else 0.0
        out[f"{name}_us_per_layer"] = round(
            graph_replay_ms(lambda p=prod: run(p), repeats) * 1000 / layers, 2)
    floor = sum(n * k * 2 for n, k in shapes(model).values()) / 3.0e12 * 1e6
    out["weight_floor_us"] = round(floor, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--rows", default="64,128,256")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None, help="append JSON lines here too")
    args = ap.parse_args()
    sink = open(args.out, "a") if args.out else None  # noqa: SIM115 (open for the whole run)

    def emit(rec: dict) -> None:
        line = json.dumps(rec, default=str)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()

    rows = [int(r) for r in args.rows.split(",")]
    all_ok = True
    for model in args.models.split(","):
        best, ok = alone(model, rows, args.repeats, emit)
        all_ok &= ok
        chain(model, rows, best, args.repeats, emit)
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
