"""INT8 W8A8 (compressed-tensors int-quantized) on the GPU; the CPU tests run the same formula in
torch and the Triton kernels in the interpreter (tests/worker/test_prequant_int8.py).

    TRITON_INTERPRET=0 PYTHONPATH=... python3 tests/gpu/test_int8.py [--json F] [--sweep]

1. kernels/int8_gemm.py compiled, on Qwen3-8B projection shapes (N, K) and 1 to 4,096 rows:
   the activation quantization against quant/int8.quantize_rows (int8 rows and scales bit for
   bit), the GEMM against the exact integer dot (float64) times the scales, the whole product in
   bf16 against the fp32 reference; its µs (quantization included; the GEMM alone; torch._int_mm
   with a torch epilogue from 17 rows) beside bf16 F.linear, the weights rotated through copies
   larger than L2 so every call streams them from memory.
2. A CUDA graph of the product replays to the eager result.
3. The embedded model (models/tiny) as a compressed-tensors int8 checkpoint (per-token and
   static), kept int8, against the same model holding the dequantized weights in bf16.
--sweep times candidate launch shapes per batch size (a layer's four projections) and prints
the fastest, for CONFIGS in kernels/int8_gemm.py. Runs in well under 2 minutes without it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # Qwen3-8B qkv, o, gate_up, down
ROWS = (1, 16, 64, 256, 1024, 4096)
L2_BYTES = 256 * 2**20  # weight copies per shape cover this much, so no call hits L2


def _us(fn, reps: int = 30) -> float:  # noqa: ANN001 - fn(i) for the i-th call
    for i in range(3):
        fn(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(reps):
        fn(i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def check_kernels(records: list[dict]) -> list[str]:
    from minisgl_worker.kernels import int8_gemm as k8
    from minisgl_worker.quant import int8 as q8

    failures = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in SHAPES:
        copies = max(2, -(-L2_BYTES // (n * k)))
        wb = [(torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
              for _ in range(copies)]
        wq = [q8.quantize_weight(w) for w in wb]
        qw, sw = wq[0]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            qx, sx = k8.quantize(x)
            rq, rs = q8.quantize_rows(x)
            # Off by one code on ~1e-5 of the elements on an H200 (rounding ties: the kernel's
            # half-to-even trick and torch.round disagree there); any larger gap is a bug.
            q_bad = int(((qx.int() - rq.int()).abs() > 1).sum().item()
                        + (sx != rs).sum().item())
            q_ties = int((qx != rq).sum().item())
            gemm_err = _rel(k8.int8_gemm(qx, qw, sx, sw, torch.float32),
                            q8.int_product(qx, sx, qw, sw))
            out_err = _rel(k8.linear(x, qw, sw), q8.reference_linear(x, qw, sw))
            t_int8 = _us(lambda i, x=x, wq=wq: k8.linear(x, *wq[i % len(wq)]))
            t_gemm = _us(lambda i, qx=qx, sx=sx, wq=wq: k8.int8_gemm(
                qx, wq[i % len(wq)][0], sx, wq[i % len(wq)][1], torch.bfloat16))
            t_int_mm = _us(lambda i, qx=qx, sx=sx, wq=wq: k8.int_mm(
                qx, wq[i % len(wq)][0], sx, wq[i % len(wq)][1], torch.bfloat16)) if m > 16 else None
            t_bf16 = _us(lambda i, x=x, wb=wb: torch.nn.functional.linear(x, wb[i % len(wb)]))
            ok = q_bad == 0 and q_ties <= qx.numel() * 1e-4 and gemm_err < 1e-6 and out_err < 1e-2
            rec = {"n": n, "k": k, "m": m, "quant_mismatches": q_bad, "quant_ties": q_ties,
                   "gemm_err": gemm_err,
                   "bf16_out_err": out_err, "int8_us": round(t_int8, 1),
                   "gemm_us": round(t_gemm, 1),
                   "int_mm_us": None if t_int_mm is None else round(t_int_mm, 1),
                   "bf16_us": round(t_bf16, 1), "speedup": round(t_bf16 / t_int8, 2), "ok": ok}
            records.append(rec)
            print(json.dumps(rec))
            if not ok:
                failures.append(f"kernel {n}x{k} m={m}")
        for m in (7, 300):  # static activation scale (saturating a few entries)
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            s = x.float().abs().max().reshape(1) / 127 * 0.9
            err = _rel(k8.linear(x, qw, sw, s), q8.reference_linear(x, qw, sw, s))
            print(json.dumps({"n": n, "k": k, "m": m, "static_err": err}))
            if err >= 1e-2:
                failures.append(f"static {n}x{k} m={m}")
    return failures


def check_graph() -> list[str]:
    from minisgl_worker.kernels import int8_gemm as k8
    from minisgl_worker.quant import int8 as q8

    failures = []
    qw, sw = q8.quantize_weight(torch.randn(4096, 4096, device="cuda") * 0.02)
    for m in (1, 16, 64):
        x = torch.randn(m, 4096, device="cuda").bfloat16()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            k8.linear(x, qw, sw)  # compiled before capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = k8.linear(x, qw, sw)
        x.copy_(torch.randn_like(x))
        graph.replay()
        ok = torch.equal(out, k8.linear(x, qw, sw))
        print(json.dumps({"cuda_graph_rows": m, "ok": ok}))
        if not ok:
            failures.append(f"graph m={m}")
    return failures


def check_models() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from minisgl_core.step import ReqPlan, StepPlan
    from minisgl_worker.engine import Engine, EngineConfig
    from minisgl_worker.quant_load.int8 import PackedInt8Linear
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from tests.worker.fp8_checkpoints import calibrate
    from tests.worker.int8_checkpoints import FORMATS, write_int8_checkpoint

    tiny = ROOT / "models" / "tiny"
    prompt = [(7 * i + 3) % 4096 for i in range(40)]
    # static scales: the max |input| of each linear over the prompt (fp32 HF model, CPU)
    amax = calibrate(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), [prompt])
    plan = StepPlan(0, [ReqPlan(rid=0, slot=0, cache_len=0, input_ids=prompt,
                                new_pages=list(range(10)), sample=False)])
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in FORMATS:
            ref = write_int8_checkpoint(tiny, Path(tmp) / fmt, fmt, input_amax=amax)
            deq = Path(shutil.copytree(tiny, Path(tmp) / f"{fmt}-deq",
                                       ignore=shutil.ignore_patterns("*.safetensors")))
            save_file({k: v.bfloat16() for k, v in ref.items()}, str(deq / "model.safetensors"))
            logits = {}
            for name, path in (("int8", Path(tmp) / fmt), ("deq", deq)):
                eng = Engine(EngineConfig(model_path=str(path), page_size=4, num_pages=64,
                                          max_slots=2, dtype="bfloat16"))
                n8 = sum(isinstance(m, PackedInt8Linear) for m in eng.model.modules())
                if (n8 > 0) != (name == "int8"):
                    failures.append(f"{fmt} {name}: {n8} int8 layers")
                logits[name] = eng.forward_logits(plan).float()
                eng.close()
            err = ((logits["int8"] - logits["deq"]).norm() / logits["deq"].norm()).item()
            agree = (logits["int8"].argmax(-1) == logits["deq"].argmax(-1)).float().mean().item()
            # bf16 activations on both sides; per-tensor scales round small tokens coarser
            ok = err < (0.05 if fmt == "channel" else 0.1) and agree >= 0.8
            print(json.dumps({"model": fmt, "rel_err": round(err, 4), "agreement": agree,
                              "ok": ok}))
            if not ok:
                failures.append(f"model {fmt}")
    return failures


def sweep() -> None:
    from minisgl_worker.kernels import int8_gemm as k8
    from minisgl_worker.quant import int8 as q8

    weights = {}
    for n, k in SHAPES:
        copies = max(2, -(-L2_BYTES // (n * k)))
        weights[(n, k)] = [q8.quantize_weight(torch.randn(n, k, device="cuda") * 0.02)
                           for _ in range(copies)]
    for m in ROWS:
        acts = {k: k8.quantize(torch.randn(m, k, device="cuda").bfloat16()) for _, k in SHAPES}

        def layer_us(cfg: tuple | None, acts: dict = acts) -> float:
            total = 0.0
            for (_, k), ws in weights.items():
                qa, sa = acts[k]
                total += _us(lambda i, qa=qa, sa=sa, ws=ws: k8.int8_gemm(
                    qa, ws[i % len(ws)][0], sa, ws[i % len(ws)][1], torch.bfloat16, cfg))
            return total

        results = []
        bms = (16,) if m <= 16 else (32, 64) if m <= 64 else (64, 128)
        for bm in bms:
            for bn in ((16, 32, 64) if m <= 64 else (64, 128, 256)):
                for bk in (128, 256):
                    for warps, stages in ((4, 3), (4, 4), (8, 3), (8, 4)):
                        cfg = (bm, bn, bk, warps, stages)
                        try:
                            results.append((round(layer_us(cfg), 1), cfg))
                        except Exception as e:  # noqa: BLE001 - shared memory limits
                            print(json.dumps({"rows": m, "config": cfg, "error": str(e)[:80]}))
        results.sort()
        print(json.dumps({"rows": m, "default": k8.config_for(m),
                          "default_us": round(layer_us(None), 1), "best": results[:5]}))


def test_int8_on_gpu() -> None:
    import pytest

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs int8 tensor cores (sm80+)")
    failures = check_kernels([]) + check_graph() + check_models()
    assert not failures, failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the kernel records (correctness, µs) to this file")
    ap.add_argument("--sweep", action="store_true", help="only sweep the GEMM's launch shapes")
    args = ap.parse_args()
    if args.sweep:
        sweep()
        return 0
    records: list[dict] = []
    fails = check_kernels(records) + check_graph() + check_models()
    if args.json:
        Path(args.json).write_text(json.dumps({"kernels": records, "failures": fails}, indent=1))
    print("FAILURES:", fails if fails else "none")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
