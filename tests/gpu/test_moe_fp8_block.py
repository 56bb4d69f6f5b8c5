"""GPU check of the block-scaled fp8 experts (kernels/moe_fp8_block.py: pre-quantized
Qwen3-30B-A3B-FP8 / DeepSeek-V3 experts) at Qwen3-30B-A3B shapes: accuracy, then speed beside
bf16 fused_moe and the per-row fp8 experts of --quantization fp8.

    TRITON_INTERPRET=0 python3 tests/gpu/test_moe_fp8_block.py [--sweep] [--json F]
        [--shape qwen3-30b-a3b|qwen3-30b-a3b-tp2|deepseek-v2-lite] [--tokens 1 8 ...]

Per batch size T: the kernel against the block formula in fp32 torch on the same fp8 operands
(quant/fp8_experts.moe_block_reference; --tol, default 1e-2, relative Frobenius), and against
the unquantized fp32 experts (what quantization costs); its CUDA-graph replay must equal the
eager output bit for bit. Then the CUDA-graph µs of the three paths (L2 flushed before each
call) and the touched experts' weight bytes / time in GB/s (decode sizes are memory-bound).
--sweep times tile candidates per T (gate_up and down tuned apart, the other at its default)
and prints the best three, to re-tune moe_fp8_block.choose_config. Then a tiny Qwen3-MoE
block-FP8 checkpoint (tests/worker/fp8_checkpoints.py) loaded with its experts kept fp8 against
the same weights dequantized in bf16. About a minute on an H200, --sweep about two more.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
for sub in ("", "services/worker", "libs/minisgl_core"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "qwen3-30b-a3b-tp2": (128, 2048, 384, 8),
          "deepseek-v2-lite": (64, 2048, 1408, 6)}
TOKENS = (1, 8, 64, 256, 1024, 4096)


def _experts(e: int, h: int, inter: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    from minisgl_worker.kernels.fused_moe import quantize_experts

    from bench.common.fp8_dir import block_quantize

    w13 = torch.randn(e, 2 * inter, h, device="cuda", generator=gen) / h**0.5
    w2 = torch.randn(e, h, inter, device="cuda", generator=gen) / inter**0.5
    (qg, sg), (qu, su) = block_quantize(w13[:, :inter]), block_quantize(w13[:, inter:])
    q2, s2 = block_quantize(w2)
    (r13, rs13), (r2, rs2) = quantize_experts(w13), quantize_experts(w2)
    return dict(w13=w13, w2=w2, q13=torch.cat([qg, qu], 1), s13=torch.cat([sg, su], 1), q2=q2,
                s2=s2, b13=w13.bfloat16(), b2=w2.bfloat16(), r13=r13, rs13=rs13, r2=r2, rs2=rs2)


def _sweep_configs(t: int) -> list:
    from minisgl_worker.kernels.fused_moe import GemmTile, MoeConfig
    from minisgl_worker.kernels.moe_fp8_block import choose_config

    block_ms = [16, 32] if t <= 128 else [16, 32, 64] if t <= 512 else [64, 128]
    tiles = [(32, 128, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 4, 3),
             (128, 128, 8, 3), (128, 64, 4, 4), (256, 128, 8, 3)]
    swapped = [(64, 128, 4, 3), (128, 128, 4, 3)] if t <= 64 else []
    cands = [GemmTile(*x) for x in tiles] + [GemmTile(*x, swap_ab=True) for x in swapped]
    base = choose_config(t)
    return list(dict.fromkeys(
        [MoeConfig(bm, u, base.down) for bm, u in itertools.product(block_ms, cands)]
        + [MoeConfig(bm, base.gate_up, d) for bm, d in itertools.product(block_ms, cands)]))


def check_kernels(shape: str, tokens: list[int], tol: float, sweep: bool,
                  iters: int) -> tuple[list[dict], list[str]]:
    from minisgl_worker.kernels.fused_moe import fused_moe_triton, moe_reference, route
    from minisgl_worker.kernels.moe_fp8_block import choose_config, fused_moe_fp8_block
    from minisgl_worker.quant.fp8_experts import moe_block_reference

    from bench.common.roofline import measure_hbm_bandwidth
    from tests.gpu.test_moe import Timer, graph_time, rel_err

    e, h, inter, top_k = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = _experts(e, h, inter, gen)
    hbm, timer = measure_hbm_bandwidth(), Timer()
    print(f"{torch.cuda.get_device_name()}  copy {hbm / 1e12:.2f} TB/s  {shape}: E={e} H={h} "
          f"I={inter} top_k={top_k}")
    print(f"{'T':>5} {'err':>8} {'vs fp32':>8} {'block us':>9} {'GB/s':>6} {'%HBM':>5} "
          f"{'row us':>8} {'bf16 us':>8} {'vs bf16':>7}")
    rows, fails = [], []
    for t in tokens:
        x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
        weights, ids = route(torch.randn(t, e, device="cuda", generator=gen).bfloat16(),
                             top_k, True)
        block = partial(fused_moe_fp8_block, x, w["q13"], w["q2"], ids, weights, w["s13"],
                        w["s2"])
        per_row = partial(fused_moe_triton, x, w["r13"], w["r2"], ids, weights,
                          w13_scale=w["rs13"], w2_scale=w["rs2"])
        bf16 = partial(fused_moe_triton, x, w["b13"], w["b2"], ids, weights)
        out = block()
        exact = moe_block_reference(x, w["q13"], w["q2"], ids, weights, w["s13"], w["s2"])
        fp32 = moe_reference(x.float(), w["w13"], w["w2"], ids, weights.float())
        err, err32 = rel_err(out, exact), rel_err(out, fp32)
        block_ms, equal = graph_time(block, out, timer, iters)
        row_ms, _ = graph_time(per_row, per_row(), timer, iters)
        bf16_ms, _ = graph_time(bf16, bf16(), timer, iters)
        touched = int(ids.unique().numel())
        nbytes = touched * 3 * h * inter  # fp8: a byte a weight (scales: 0.01 %)
        gbps = nbytes / (block_ms * 1e-3) / 1e9
        ok = err <= tol and equal
        print(f"{t:>5} {err:>8.1e} {err32:>8.1e} {block_ms * 1e3:>9.1f} {gbps:>6.0f} "
              f"{100 * gbps * 1e9 / hbm:>4.0f}% {row_ms * 1e3:>8.1f} {bf16_ms * 1e3:>8.1f} "
              f"{bf16_ms / block_ms:>6.2f}x" + ("" if equal else "  GRAPH OUTPUT DIFFERS")
              + ("" if ok else "  FAIL"))
        if not ok:
            fails.append(f"kernel {shape} T={t}")
        row = dict(tokens=t, err=err, err_vs_fp32=err32, graph_equal=equal,
                   block_us=block_ms * 1e3, per_row_fp8_us=row_ms * 1e3, bf16_us=bf16_ms * 1e3,
                   weight_gb_per_s=gbps, config=repr(choose_config(t)))
        if sweep:
            row["sweep"] = _sweep(t, block, out, timer, max(10, iters // 3), block_ms)
        rows.append(row)
    return rows, fails


def _sweep(t: int, call, default_out: torch.Tensor, timer, iters: int,  # noqa: ANN001
           default_ms: float) -> list[dict]:
    from tests.gpu.test_moe import rel_err

    results = []
    for cfg in _sweep_configs(t):
        try:
            err = rel_err(call(config=cfg), default_out)
            ms = timer(lambda cfg=cfg: call(config=cfg), iters)
        except Exception as exc:  # e.g. a tile needing more shared memory than there is
            print(f"    skip {cfg}: {type(exc).__name__}")
            continue
        if err > 1e-2:  # tiles reorder fp32 sums only; more is a broken config
            print(f"    WRONG ({err:.1e} from the default) {cfg}")
            continue
        results.append(dict(config=repr(cfg), us=ms * 1e3))
    results.sort(key=lambda r: r["us"])
    for r in results[:3]:
        print(f"    {r['us']:.1f} us eager ({default_ms * 1e3:.1f} default graph)  {r['config']}")
    return results


def check_model() -> list[str]:
    """The tiny Qwen3-MoE block checkpoint with its experts kept fp8 (the Triton experts) against
    the same weights dequantized in bf16: within the activations' e4m3 rounding."""
    from minisgl_core.step import ReqPlan, StepPlan
    from minisgl_worker.engine import Engine, EngineConfig
    from minisgl_worker.layers.moe import SparseMoeBlock
    from safetensors.torch import save_file

    from tests.worker.fp8_checkpoints import write_fp8_checkpoint
    from tests.worker.test_prequant_fp8_moe import _hf

    prompt = [(7 * i + 3) % 512 for i in range(40)]
    plan = StepPlan(0, [ReqPlan(rid=0, slot=0, cache_len=0, input_ids=prompt,
                                new_pages=list(range(10)), sample=False)])
    logits, fails = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        _hf("qwen3_moe").save_pretrained(src, safe_serialization=True)
        ref = write_fp8_checkpoint(src, Path(tmp) / "fp8", "block")
        deq = Path(tmp) / "deq"
        deq.mkdir()
        (deq / "config.json").write_text((src / "config.json").read_text())
        save_file({k: v.bfloat16() for k, v in ref.items()}, str(deq / "model.safetensors"))
        for name in ("fp8", "deq"):
            eng = Engine(EngineConfig(model_path=str(Path(tmp) / name), page_size=4,
                                      num_pages=64, max_slots=2, dtype="bfloat16"))
            kept = [m for m in eng.model.modules() if isinstance(m, SparseMoeBlock)
                    and m.w13.dtype == torch.float8_e4m3fn]
            if bool(kept) != (name == "fp8"):
                fails.append(f"model {name}: {len(kept)} fp8 expert blocks")
            logits[name] = eng.forward_logits(plan).float()
            eng.close()
    err = ((logits["fp8"] - logits["deq"]).norm() / logits["deq"].norm()).item()
    agree = (logits["fp8"].argmax(-1) == logits["deq"].argmax(-1)).float().mean().item()
    ok = err < 0.15 and agree >= 0.8
    print(f"model qwen3_moe block: experts kept fp8 vs dequantized bf16: rel err {err:.3f}, "
          f"greedy agreement {agree:.2f}{'' if ok else '  FAIL'}")
    return fails + ([] if ok else ["model qwen3_moe block"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--tol", type=float, default=1e-2)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--no-model", action="store_true", help="skip the tiny checkpoint check")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("test_moe_fp8_block: needs a GPU with fp8 tensor cores", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references must be fp32
    rows, fails = check_kernels(args.shape, args.tokens, args.tol, args.sweep, args.iters)
    if not args.no_model:
        fails += check_model()
    print("FAILURES:", fails if fails else "none")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                                   shape=args.shape, rows=rows, failures=fails),
                                              indent=1))
    return 1 if fails else 0


def test_moe_fp8_block_on_gpu() -> None:
    import pytest

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs fp8 tensor cores")
    assert main(["--tokens", "1", "64", "1024", "--iters", "20"]) == 0


if __name__ == "__main__":
    sys.exit(main())
