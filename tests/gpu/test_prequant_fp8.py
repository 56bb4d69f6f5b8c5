"""Pre-quantized FP8 checkpoints on the GPU (the CPU tests run the same formulas in fp32 torch and
the block kernel in Triton's interpreter: tests/worker/test_prequant_fp8.py).

    TRITON_INTERPRET=0 PYTHONPATH=... python3 tests/gpu/test_prequant_fp8.py   # or make test-gpu

1. kernels/fp8_block_gemm.py compiled, on Qwen3-8B projection shapes and 1 to 4,096 rows,
   against the fp32 formula of the same quantized operands (fp8_block.block_reference), and its
   µs against bf16 F.linear; the static-activation path (torch._scaled_mm) against its formula.
2. The embedded model in the block and compressed-tensors layouts (tests/worker/fp8_checkpoints.py)
   loads with its weights kept fp8 and runs the fp8 kernels; its logits against the same model
   holding the dequantized weights in bf16: within the activations' e4m3 rounding.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288)]  # Qwen3-8B (N, K)
ROWS = (1, 7, 16, 100, 1024, 4096)


def _us(fn, reps: int = 50) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def check_kernels() -> list[str]:
    from minisgl_worker.fp8 import quantize_rows
    from minisgl_worker.fp8_block import (
        block_reference,
        dequantize_blocks,
        quantize_groups,
        static_reference,
    )
    from minisgl_worker.kernels.fp8_block_gemm import fp8_block_gemm
    from minisgl_worker.layers.fp8_linear import block_linear, static_linear

    failures = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        qw, sw = quantize_groups(w)
        wb = w.bfloat16()
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            qx, sx = quantize_groups(x)
            want = block_reference(x, qw, sw)
            got = fp8_block_gemm(qx, qw, sx, sw, torch.float32)
            err = ((got - want).abs().max() / want.abs().max()).item()
            full = block_linear(x, qw, sw)
            # one row runs weight-only (the GEMV): its formula leaves the activation unrounded
            want_full = x.float() @ dequantize_blocks(qw, sw).t() if m == 1 else want
            err_bf16 = ((full.float() - want_full).abs().max() / want_full.abs().max()).item()
            t_fp8 = _us(lambda x=x, qw=qw, sw=sw: block_linear(x, qw, sw))
            t_bf16 = _us(lambda x=x, wb=wb: torch.nn.functional.linear(x, wb))
            # wgmma's fp8 products (BLOCK_M >= 64) accumulate in reduced precision inside a
            # 128-group before the fp32 promotion: ~1.5e-4 of the output's range
            ok = err < 1e-3 and err_bf16 < 1e-2
            print(f"block N={n} K={k} M={m}: kernel err {err:.1e}, bf16 out {err_bf16:.1e}; "
                  f"{t_fp8:.1f} us (quantization included) vs bf16 {t_bf16:.1f} us"
                  f"{'' if ok else '  FAIL'}")
            if not ok:
                failures.append(f"block {n}x{k} m={m}")
        qrow, srow = quantize_rows(w)
        for m in (7, 100):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            scale = x.float().abs().max().reshape(1) / 448 * 1.2
            want = static_reference(x, qrow, srow, scale)
            got = static_linear(x, qrow, srow, scale).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            print(f"static N={n} K={k} M={m}: err {err:.1e}{'' if err < 1e-2 else '  FAIL'}")
            if err >= 1e-2:
                failures.append(f"static {n}x{k} m={m}")
    return failures


def check_models() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from minisgl_core.step import ReqPlan, StepPlan
    from minisgl_worker.engine import Engine, EngineConfig
    from minisgl_worker.layers.fp8_linear import Fp8Linear
    from safetensors.torch import save_file

    from tests.worker.fp8_checkpoints import write_fp8_checkpoint

    tiny = ROOT / "models" / "tiny"
    prompt = [(7 * i + 3) % 4096 for i in range(40)]
    plan = StepPlan(0, [ReqPlan(rid=0, slot=0, cache_len=0, input_ids=prompt,
                                new_pages=list(range(10)), sample=False)])
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("block", "ct_channel", "tensor"):
            ref = write_fp8_checkpoint(tiny, Path(tmp) / fmt, fmt)
            deq = Path(shutil.copytree(tiny, Path(tmp) / f"{fmt}-deq",
                                       ignore=shutil.ignore_patterns("*.safetensors")))
            save_file({k: v.bfloat16() for k, v in ref.items()}, str(deq / "model.safetensors"))
            logits = {}
            for name, path in (("fp8", Path(tmp) / fmt), ("deq", deq)):
                eng = Engine(EngineConfig(model_path=str(path), page_size=4, num_pages=64,
                                          max_slots=2, dtype="bfloat16"))
                n8 = sum(isinstance(m, Fp8Linear) and m.weight.dtype == torch.float8_e4m3fn
                         for m in eng.model.modules())
                if (n8 > 0) != (name == "fp8"):
                    failures.append(f"{fmt} {name}: {n8} fp8 layers")
                logits[name] = eng.forward_logits(plan).float()
                eng.close()
            err = ((logits["fp8"] - logits["deq"]).norm() / logits["deq"].norm()).item()
            agree = (logits["fp8"].argmax(-1) == logits["deq"].argmax(-1)).float().mean().item()
            ok = err < 0.1 and agree >= 0.8
            print(f"model {fmt}: fp8 kept vs dequantized bf16: rel err {err:.3f}, "
                  f"greedy agreement {agree:.2f}{'' if ok else '  FAIL'}")
            if not ok:
                failures.append(f"model {fmt}")
    return failures


def test_prequant_fp8_on_gpu() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs fp8 tensor cores")
    failures = check_kernels() + check_models()
    assert not failures, failures


if __name__ == "__main__":
    fails = check_kernels() + check_models()
    print("FAILURES:", fails if fails else "none")
    sys.exit(1 if fails else 0)
