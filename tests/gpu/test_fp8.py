"""--quantization fp8 on the GPU: the kernels against the reference formula, the projections'
speed against bf16, and a model's logits and greedy tokens against its bf16 self.

    make test-gpu                        # as a pytest test (8B shapes, 0.6B model), or with options:
    PYTHONPATH=tests:$PYTHONPATH python3 -m gpu.test_fp8 --model models/configs/Qwen3-8B \
        [--model-check models/configs/Qwen3-0.6B] [--sweep]

1. For each dense projection of the model's shape and batches of 1 to 4,096 rows: fp8.linear
   (torch._scaled_mm with row-wise scales after our row-quantization kernel; the GEMV kernel
   for one row) against the reference formula in fp32 (fp8.py), as max|diff| / max|ref|;
   the kernel's fp8 bytes and scales against torch's cast of the same values (the CPU tests
   cannot check the cast: the Triton interpreter does not round to nearest).
2. µs a call, bf16 F.linear against fp8.linear (quantization included), weights cycled through
   > 400 MB so nothing stays in L2.
2b. The norm with the quantization fused in (fused_ops.rmsnorm_quant_fp8, residual add
   included) against the two kernels it replaces: same scales, bytes equal but for rare
   one-step differences, µs of each.
3. Whole model (dummy weights, test_models' prompts): prefill logits of the fp8 model
   against the bf16 one, greedy agreement, and CUDA-graph decode equal to eager decode.
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from minisgl_worker import fp8
from minisgl_worker.kernels import fused_ops
from minisgl_worker.layers import fp8_linear

from bench.common.gpu_timing import graph_us
from gpu import test_models as models_check

ROOT = Path(__file__).resolve().parents[2]

ROWS = (1, 7, 16, 100, 256, 1024, 4096)


def shapes(model: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of each dense projection."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    return {"qkv": ((heads + 2 * kv) * hd, h), "o": (h, heads * hd),
            "gate_up": (2 * inter, h), "down": (h, inter)}


def reference(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, silu: bool) -> torch.Tensor:
    xin = fp8.silu_mul_rows(x) if silu else x
    if fused_ops.gemv_usable(x):  # the one-row GEMV keeps the activation in bf16
        return xin.float() @ (qw.float() * sw).t()
    return fp8.reference_product(xin, qw, sw)


def check_kernels(model: str, device: str) -> tuple[list[dict], bool]:
    out, ok = [], True
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in shapes(model).items():
        w = (0.02 * torch.randn(n, k, device=device, generator=gen)).bfloat16()
        qw, sw = fp8.quantize_rows(w)
        silu = name == "down"
        for m in ROWS:
            x = torch.randn(m, 2 * k if silu else k, device=device, generator=gen).bfloat16()
            got = fp8_linear.linear(x, qw, sw, silu_mul=silu).float()
            ref = reference(x, qw, sw, silu)
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            rec = {"proj": name, "rows": m, "err": round(err, 5)}
            if m > 1 and device == "cuda":
                q, s = fused_ops.quantize_rows_fp8(x, silu_mul=silu)
                q_ref, s_ref = fp8.quantize_rows(fp8.silu_mul_rows(x) if silu else x)
                rec["scale_mismatch"] = int((s != s_ref).sum())
                rec["byte_mismatch"] = int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum())
                # silu's exp may differ from torch's in the last bit: allow a few one-step flips
                limit = 0 if not silu else max(1, q.numel() // 1000)
                ok &= rec["scale_mismatch"] <= (0 if not silu else m) and \
                    rec["byte_mismatch"] <= limit
            ok &= err < 1e-2  # bf16 output rounding: ~4e-3
            out.append(rec)
    return out, ok


def check_norm_quant(model: str) -> tuple[list[dict], bool]:
    """Fused residual-add + RMSNorm + row quantization against rmsnorm then quantize_rows_fp8:
    the same residual and scales, and the same fp8 bytes except for rare elements one fp8 step
    apart (on an H100 ~15 in 10^8, with PDL on or off and 4-16 warps; quantize_rows_fp8 alone
    equals torch's cast byte for byte)."""
    h = shapes(model)["qkv"][1]
    w = (1 + 0.1 * torch.randn(h, device="cuda")).bfloat16()
    out, ok = [], True
    for m in (7, 256, 2048):
        x = torch.randn(m, h, device="cuda").bfloat16()
        res = torch.randn(m, h, device="cuda").bfloat16()
        res_a, res_b = res.clone(), res.clone()
        q_ref, s_ref = fused_ops.quantize_rows_fp8(fused_ops.rmsnorm(x, w, 1e-6, res_a))
        q, s = fused_ops.rmsnorm_quant_fp8(x, w, 1e-6, res_b)
        codes, codes_ref = q.view(torch.int8).int(), q_ref.view(torch.int8).int()
        differ = int((codes != codes_ref).sum())
        steps = int((codes - codes_ref).abs().max())  # same sign: one code apart = one step
        good = (torch.equal(s, s_ref) and torch.equal(res_a, res_b) and steps <= 1
                and differ <= max(1, q.numel() // 100_000))
        ok &= good
        # (each call adds x to res again: the timing does not depend on the values)
        two = timed(lambda i, x=x, res=res: fused_ops.quantize_rows_fp8(
            fused_ops.rmsnorm(x, w, 1e-6, res)))
        one = timed(lambda i, x=x, res=res: fused_ops.rmsnorm_quant_fp8(x, w, 1e-6, res))
        out.append({"norm_quant_rows": m, "bytes_differing": differ, "max_fp8_steps": steps,
                    "ok": good, "two_kernels_us": round(two, 1), "fused_us": round(one, 1)})
    return out, ok


def timed(fn) -> float:  # noqa: ANN001
    """µs a call of fn(i), from CUDA graphs of such calls (bench.common.gpu_timing.graph_us; eager
    timing would measure the Python launch of the Triton kernels, ~20-50 µs, not the GPU)."""
    return graph_us(fn, iters=5)


def bench_projection(n: int, k: int, m: int) -> dict:
    """µs a call of one projection, bf16 against fp8 (quantization included)."""
    copies = max(2, -(-400 * 2**20 // (n * k * 2)))
    ws = [(0.02 * torch.randn(n, k, device="cuda")).bfloat16() for _ in range(copies)]
    qs = [fp8.quantize_rows(w) for w in ws]
    x = torch.randn(m, k, device="cuda").bfloat16()

    def scaled_mm(i: int) -> torch.Tensor:
        qx, sx = fused_ops.quantize_rows_fp8(x)
        qw, sw = qs[i % copies]
        return torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.view(1, -1),
                                out_dtype=x.dtype)

    bf16 = timed(lambda i: fused_ops.linear(x, ws[i % copies]))
    f8 = timed(lambda i: fp8_linear.linear(x, *qs[i % copies]))
    rec = {"n": n, "k": k, "rows": m, "bf16_us": round(bf16, 1), "fp8_us": round(f8, 1),
           "speedup": round(bf16 / f8, 2)}
    if m > 1:
        quant = timed(lambda i: fused_ops.quantize_rows_fp8(x))
        rec.update(quant_us=round(quant, 1), fp8_scaled_mm_us=round(timed(scaled_mm), 1))
    return rec


def sweep_candidates(m: int) -> list[tuple[int, ...]]:
    """Launch shapes to try, with both promoting accumulation modes (0, 1); the fastest three
    are then timed without promotion (mode 2) for comparison."""
    out = []
    for bm in (16,) if m <= 16 else (32, 64) if m <= 64 else (64, 128, 256):
        for bn in (16, 32, 64) if m <= 64 else (64, 128):
            for bk in (128, 256):
                for stages in (3, 4):
                    for warps in (4, 8):
                        if (warps == 8 and bm * bn < 64 * 128) or \
                                (warps == 4 and bm * bn > 128 * 64) or (bm == 256 and bk == 256):
                            continue
                        out += [(bm, bn, bk, warps, stages, mode) for mode in (0, 1)]
    return out


def sweep(model: str) -> None:
    """Time every candidate launch shape of the Triton GEMM for each decode batch size over the
    model's four projections (a layer's GEMM time), against torch._scaled_mm."""
    from minisgl_worker.kernels import fp8_gemm

    projs = shapes(model)
    weights = {}
    for name, (n, k) in projs.items():
        copies = max(2, -(-400 * 2**20 // (n * k)))
        weights[name] = [fp8.quantize_rows((0.02 * torch.randn(n, k, device="cuda")).bfloat16())
                         for _ in range(copies)]
    for m in (16, 64, 128, 256):
        acts = {name: fp8.quantize_rows(torch.randn(m, k, device="cuda").bfloat16())
                for name, (n, k) in projs.items()}

        def layer_us(gemm, acts: dict = acts) -> float:  # noqa: ANN001
            total = 0.0
            for name in projs:
                (qa, sa), ws = acts[name], weights[name]
                total += timed(lambda i, qa=qa, sa=sa, ws=ws: gemm(qa, sa, *ws[i % len(ws)]))
            return total

        base = layer_us(lambda qa, sa, qw, sw: torch._scaled_mm(
            qa, qw.t(), scale_a=sa, scale_b=sw.view(1, -1), out_dtype=torch.bfloat16))
        results = []
        for cfg in sweep_candidates(m):
            try:
                us = layer_us(lambda qa, sa, qw, sw, cfg=cfg: fp8_gemm.fp8_gemm(
                    qa, qw, sa, sw, torch.bfloat16, cfg))
            except Exception as e:  # noqa: BLE001 - shared memory or register limits
                print(json.dumps({"rows": m, "config": cfg, "error": str(e)[:80]}))
                continue
            results.append((us, cfg))
        results.sort()
        operands = (*acts["down"], *weights["down"][0])

        def err(cfg: tuple[int, ...], operands: tuple = operands) -> float:
            qa, sa, qw, sw = operands
            ref = (qa.float() @ qw.float().t()) * sa * sw.view(1, -1)
            got = fp8_gemm.fp8_gemm(qa, qw, sa, sw, torch.bfloat16, cfg).float()
            return round(((got - ref).abs().max() / ref.abs().max()).item(), 5)

        no_promotion = []
        for _, cfg in results[:3]:
            raw = (*cfg[:5], 2)
            no_promotion.append((round(layer_us(lambda qa, sa, qw, sw, c=raw: fp8_gemm.fp8_gemm(
                qa, qw, sa, sw, torch.bfloat16, c)), 1), raw, err(raw)))
        print(json.dumps({"rows": m, "scaled_mm_layer_us": round(base, 1),
                          "best": [(round(us, 1), c, err(c)) for us, c in results[:6]],
                          "no_promotion": no_promotion, "default": fp8_gemm.config_for(m)}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="config dir whose projection shapes to use")
    ap.add_argument("--model-check", default=None,
                    help="config dir for the whole-model check (default: --model)")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="only sweep the Triton GEMM's configs")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    args = ap.parse_args(argv)
    models_check.DEVICE = args.device
    if args.sweep:
        sweep(args.model)
        return 0

    kernels, ok = check_kernels(args.model, args.device)
    for rec in kernels:
        print(json.dumps(rec))
    if args.device == "cuda":
        norm_recs, norm_ok = check_norm_quant(args.model)
        ok &= norm_ok
        for rec in norm_recs:
            print(json.dumps(rec))
    for name, (n, k) in shapes(args.model).items():
        for m in (1, 64, 256, 2048) if args.device == "cuda" else ():
            print(json.dumps({"bench": name, **bench_projection(n, k, m)}))
    if not args.skip_model:
        model = args.model_check or args.model
        bf16, ref = models_check.check_backend(model, "auto", None, args.max_len)
        print(json.dumps({"model": Path(model).name, "quantization": "none", **bf16}))
        q, _ = models_check.check_backend(model, "auto", ref, args.max_len, quantization="fp8")
        print(json.dumps({"model": Path(model).name, "quantization": "fp8", **q}))
        pieces = args.device != "cuda" or q["piecewise_replays"] > 0  # CPU: a dry run, no graphs
        ok &= bool(q["graph_equals_eager"]) and pieces
        kv, _ = models_check.check_backend(model, "auto", ref, args.max_len, quantization="fp8",
                                           kv_cache_dtype="fp8_e4m3")
        print(json.dumps({"model": Path(model).name, "quantization": "fp8", "kv": "fp8_e4m3", **kv}))
        ok &= bool(kv["graph_equals_eager"]) and (args.device != "cuda" or kv["piecewise_replays"] > 0)
    print(json.dumps({"ok": ok}))
    return 0 if ok else 1


def test_fp8_kernels_and_model() -> None:
    """fp8 products and the fused norm+quant against their references at Qwen3-8B's shapes;
    Qwen3-0.6B fp8 weights (and fp8 weights with an fp8 KV cache) with CUDA-graph decode and
    piecewise-graph prompts equal to eager."""
    configs = ROOT / "models" / "configs"
    assert main(["--model", str(configs / "Qwen3-8B"),
                 "--model-check", str(configs / "Qwen3-0.6B")]) == 0


if __name__ == "__main__":
    sys.exit(main())
