"""Block-scaled fp8 GEMMs on the GPU, Qwen3-8B projection shapes: the layer's path
(layers/fp8_linear.block_linear: GEMV for one row, cuBLASLt's blockwise scaled_mm from
CUBLAS_MIN_ROWS rows, our Triton kernel between), each candidate alone, and bf16 F.linear; errors
against the fp32 formula (fp8_block.block_reference).

    python -m bench.micro.fp8_block [--json F]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
ROWS = (1, 2, 8, 16, 17, 64, 100, 256, 1024, 4096)


def _us(fn, reps: int = 30) -> float:  # noqa: ANN001
    """µs a call, replayed from a CUDA graph (launch gaps out, as in decode steps)."""
    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def _weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w bf16, q fp8, per-row view of its 128x128 block scales, the blocks)."""
    w = torch.randn(n, k, device="cuda") * 0.02
    blocks = w.view(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)) / 448
    rows = blocks.repeat_interleave(128, 0)
    q = (w / rows.repeat_interleave(128, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w.bfloat16(), q, rows.contiguous(), blocks.contiguous()


def case(n: int, k: int, m: int, weights: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    from minisgl_worker.fp8_block import block_reference
    from minisgl_worker.kernels import fp8_block_gemm as kern
    from minisgl_worker.layers.fp8_linear import block_linear

    wb, q, rows, blocks = weights
    x = torch.randn(m, k, device="cuda").bfloat16()
    want = block_reference(x, q, rows)
    row: dict[str, Any] = dict(n=n, k=k, m=m)
    row["layer_err"] = _err(block_linear(x, q, rows, blocks=blocks), want)
    row["layer_us"] = _us(lambda: block_linear(x, q, rows, blocks=blocks))
    row["bf16_us"] = _us(lambda: F.linear(x, wb))
    qx, sx = kern.quantize_groups_fp8(x)
    row["quant_us"] = _us(lambda: kern.quantize_groups_fp8(x))
    row["triton_err"] = _err(kern.fp8_block_gemm(qx, q, sx, rows, torch.bfloat16), want)
    row["triton_us"] = _us(lambda: kern.fp8_block_gemm(qx, q, sx, rows, torch.bfloat16))
    try:
        row["cublas_err"] = _err(kern.blockwise_mm(x, q, blocks), want)
        row["cublas_us"] = _us(lambda: kern.blockwise_mm(x, q, blocks))
    except Exception as e:  # noqa: BLE001 - report and go on
        row["cublas_error"] = str(e).splitlines()[0][:100]
    if m == 1:  # the GEMV's configs
        from minisgl_worker.kernels import fused_ops
        best = None
        for cfg in [(bn, bk, wp, st) for bn in (1, 2, 4, 8) for bk in (256, 512, 1024)
                    for wp in (4, 8) for st in (2, 3, 4)]:
            t = _us(lambda cfg=cfg: fused_ops.gemv(x, q, w_scale=rows, scale_group=128,
                                                   config=cfg))
            best = min(best or (t, cfg), (t, cfg))
        row["gemv_best"] = best
    row["weight_GBps_layer"] = q.numel() / row["layer_us"] / 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    out = []
    print(f"torch {torch.__version__}")
    for n, k in SHAPES:
        weights = _weights(n, k)
        for m in ROWS:
            r = case(n, k, m, weights)
            out.append(r)
            print(f"{n}x{k} m={m}: layer {r['layer_us']:.1f} us ({r['weight_GBps_layer']:.0f} GB/s)"
                  f" err {r['layer_err']:.1e} | triton {r['triton_us']:.1f} | cublas "
                  f"{r.get('cublas_us', float('nan')):.1f} {r.get('cublas_error', '')}| bf16 "
                  f"{r['bf16_us']:.1f} | quant {r['quant_us']:.1f} {r.get('gemv_best', '')}")
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in out)


if __name__ == "__main__":
    main()
