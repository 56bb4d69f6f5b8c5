"""GPU check of the fused MoE kernels at Qwen3-30B-A3B shapes: accuracy, then speed.

    make test-gpu                        # as a pytest test (bf16 and fp8 experts), or with options:
    source bench/gpu_env.sh
    PYTHONPATH=tests:$PYTHONPATH python3 -m gpu.test_moe [--json moe.json] [--sweep] [--fp8]

For each batch size T: bf16 `fused_moe_triton` and bf16 `moe_reference` are compared with an fp32
reference (relative Frobenius error); then both are timed with CUDA events, the median of many runs
with L2 flushed before each, and the fused op also as a replayed CUDA graph (no launch overhead, as
in decode serving; its output must equal the eager one bit for bit). Decode sizes are read as
bandwidth (bytes of the touched experts' weights / time), prefill sizes as TFLOP/s
(2 * T * top_k * 3 * H * I / time). --sweep times a grid of tile configs per T and prints the best,
to re-tune `choose_config`. Exit status 1 if any fused error exceeds --tol.

--fp8 adds the fp8 experts of `--quantization fp8` (fp8 rows with one scale each, inputs
quantized per row): their error against `moe_reference`'s fp8 formula in fp32 (the kernel's own
error, --tol applies) and against the unquantized fp32 experts (what quantization costs), their
CUDA-graph time and its ratio to bf16's; --sweep then tunes the fp8 call.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from minisgl_worker.kernels.fused_moe import (
    GemmTile,
    MoeConfig,
    choose_config,
    fused_moe_triton,
    moe_reference,
    quantize_experts,
    route,
)

from bench.common.roofline import measure_hbm_bandwidth

E, H, INTER, TOP_K = 128, 2048, 768, 8  # Qwen3-30B-A3B: experts, hidden, moe_intermediate, k
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "gpt-oss-20b": (32, 2880, 2880, 4),
          "deepseek-v2-lite": (64, 2048, 1408, 6)}
DECODE_MAX_T = 64  # up to here the op is memory-bound; above, compute-bound


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class Timer:
    """Median per-call time in ms; L2 (50 MB on H100) is flushed before every call so decode
    sizes read their weights from HBM, not from the previous iteration's cache."""

    def __init__(self) -> None:
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for s, e in zip(starts, ends, strict=True):
            self.flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def bind(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> Callable[..., torch.Tensor]:
    return lambda **kw: fn(*args, **kw)


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_time(call: Callable[[], torch.Tensor], eager_out: torch.Tensor, timer: Timer,
               iters: int) -> tuple[float, bool]:
    """The op as a replayed CUDA graph: ms a replay, and whether it gives the eager output bit
    for bit (the graph is freed before returning)."""
    graph, graph_out = capture(call)
    graph.replay()
    torch.cuda.synchronize()
    equal = torch.equal(graph_out, eager_out)
    return timer(graph.replay, iters), equal


def sweep_configs(t: int, fp8: bool = False) -> list[MoeConfig]:
    block_ms = [16, 32] if t <= 128 else [32, 64] if t <= 512 else [64, 128]
    up_tiles = [(32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3),
                (128, 64, 8, 4), (128, 128, 8, 2)]
    down_tiles = [(64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 3), (256, 64, 8, 3),
                  (256, 64, 8, 4), (256, 128, 8, 2)]
    if fp8:  # a byte a weight: the same bytes a step take twice the K
        up_tiles += [(32, 256, 4, 4), (64, 256, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3)]
        down_tiles += [(64, 256, 4, 4), (128, 256, 8, 3), (128, 128, 4, 4), (256, 128, 8, 3)]
    up = [GemmTile(*tile) for tile in up_tiles]
    down = [GemmTile(*tile) for tile in down_tiles]
    base = choose_config(t, fp8)
    # Tune each GEMM's tile with the other at its default: the two launches are independent.
    return list(dict.fromkeys(
        [MoeConfig(bm, u, base.down) for bm, u in itertools.product(block_ms, up)]
        + [MoeConfig(bm, base.gate_up, d) for bm, d in itertools.product(block_ms, down)]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--tol", type=float, default=1e-2, help="max fused rel. error vs fp32")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--fp8", action="store_true", help="also fp8 experts (see above)")
    p.add_argument("--json", default=None)
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES),
                   help="the experts' shape (E, H, I, top-k) of this model")
    args = p.parse_args(argv)
    global E, H, INTER, TOP_K
    E, H, INTER, TOP_K = SHAPES[args.shape]
    if not torch.cuda.is_available():
        print("test_moe: needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    w13_32 = torch.randn(E, 2 * INTER, H, device=dev) / H**0.5
    w2_32 = torch.randn(E, H, INTER, device=dev) / INTER**0.5
    w13, w2 = w13_32.to(bf16), w2_32.to(bf16)
    expert_bytes = 3 * H * INTER * w13.element_size()
    fp8: dict[str, torch.Tensor] = {}
    if args.fp8:
        (q13, s13), (q2, s2) = quantize_experts(w13), quantize_experts(w2)
        fp8 = dict(q13=q13, q2=q2, w13_scale=s13, w2_scale=s2)
    hbm = measure_hbm_bandwidth()
    timer = Timer()
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {hbm / 1e12:.2f} TB/s  "
          f"E={E} H={H} I={INTER} top_k={TOP_K} bf16")
    print(f"{'T':>5} {'experts':>7} {'err fused':>9} {'err ref':>9} {'fused ms':>9} "
          f"{'graph ms':>9} {'ref ms':>9} {'speedup':>7} {'GB/s':>7} {'%HBM':>5} {'TFLOP/s':>7}")
    rows, ok = [], True
    for t in args.tokens:
        x = torch.randn(t, H, device=dev, dtype=bf16)
        weights, ids = route(torch.randn(t, E, device=dev, dtype=bf16), TOP_K, True)
        want = moe_reference(x.float(), w13_32, w2_32, ids, weights.float())
        call = bind(fused_moe_triton, x, w13, w2, ids, weights)
        if fp8:
            call8 = _fp8_call(x, fp8, ids, weights)
        out = call()
        ref = moe_reference(x, w13, w2, ids, weights)
        err_fused, err_ref = rel_err(out, want), rel_err(ref, want)
        ok &= err_fused <= args.tol

        fused_ms = timer(call, args.iters)
        graph_ms, graph_equal = graph_time(call, out, timer, args.iters)
        ok &= graph_equal
        ref_ms = timer(bind(moe_reference, x, w13, w2, ids, weights), max(5, args.iters // 10))

        touched = int(ids.unique().numel())
        gbps = touched * expert_bytes / (graph_ms * 1e-3) / 1e9
        tflops = 2 * t * TOP_K * 3 * H * INTER / (fused_ms * 1e-3) / 1e12
        row = dict(tokens=t, experts_touched=touched, err_fused=err_fused, err_ref=err_ref,
                   fused_ms=fused_ms, graph_ms=graph_ms, ref_ms=ref_ms, graph_equal=graph_equal,
                   weight_gb_per_s=gbps, tflops=tflops, config=repr(choose_config(t)))
        print(f"{t:>5} {touched:>7} {err_fused:>9.2e} {err_ref:>9.2e} {fused_ms:>9.4f} "
              f"{graph_ms:>9.4f} {ref_ms:>9.3f} {ref_ms / fused_ms:>6.1f}x "
              f"{gbps:>7.0f} {100 * gbps * 1e9 / hbm:>4.0f}% {tflops:>7.1f}"
              + ("" if graph_equal else "  GRAPH OUTPUT DIFFERS"))
        if fp8:
            row["fp8"] = _check_fp8(x, fp8, ids, weights, want, call8, timer, args.iters,
                                    graph_ms, touched * expert_bytes // 2)
            ok &= row["fp8"]["err_kernel"] <= args.tol and row["fp8"]["graph_equal"]
        if args.sweep:
            row["sweep"] = sweep(t, call8 if fp8 else call, timer, max(10, args.iters // 4),
                                 timer(call8, args.iters) if fp8 else fused_ms, bool(fp8))
        rows.append(row)
    print(f"decode rows (T<={DECODE_MAX_T}): GB/s = touched experts' weights / CUDA-graph time; "
          "prefill rows: TFLOP/s from eager time")
    print(f"accuracy {'OK' if ok else 'FAILED'} (fused vs fp32 <= {args.tol:g}, graph == eager)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                                   hbm_bytes_per_s=hbm, rows=rows), indent=1))
    return 0 if ok else 1


def _fp8_call(x: torch.Tensor, fp8: dict[str, torch.Tensor], ids: torch.Tensor,
              weights: torch.Tensor) -> Callable[..., torch.Tensor]:
    return lambda **kw: fused_moe_triton(x, fp8["q13"], fp8["q2"], ids, weights,
                                         w13_scale=fp8["w13_scale"], w2_scale=fp8["w2_scale"],
                                         **kw)


def _check_fp8(x: torch.Tensor, fp8: dict[str, torch.Tensor], ids: torch.Tensor,
               weights: torch.Tensor, want: torch.Tensor, call: Callable[..., torch.Tensor],
               timer: Timer, iters: int, bf16_graph_ms: float, fp8_bytes: int) -> dict:
    """One batch with fp8 experts: kernel error (vs the fp8 formula in fp32), cost of
    quantization (vs the unquantized fp32 reference), graph time against bf16's."""
    out = call()
    exact = moe_reference(x, fp8["q13"], fp8["q2"], ids, weights, w13_scale=fp8["w13_scale"],
                          w2_scale=fp8["w2_scale"])  # the fp8 formula, in fp32 torch
    graph_ms, graph_equal = graph_time(call, out, timer, iters)
    res = dict(err_kernel=rel_err(out, exact), err_vs_unquantized=rel_err(out, want),
               graph_ms=graph_ms, graph_equal=graph_equal,
               speedup_vs_bf16=bf16_graph_ms / graph_ms,
               weight_gb_per_s=fp8_bytes / (graph_ms * 1e-3) / 1e9)
    print(f"      fp8: err kernel {res['err_kernel']:.2e}  vs unquantized "
          f"{res['err_vs_unquantized']:.2e}  graph {graph_ms:.4f} ms ({res['speedup_vs_bf16']:.2f}x "
          f"bf16)  {res['weight_gb_per_s']:.0f} GB/s"
          + ("" if res["graph_equal"] else "  GRAPH OUTPUT DIFFERS"))
    return res


def sweep(t: int, call: Callable[..., torch.Tensor], timer: Timer, iters: int,
          default_ms: float, fp8: bool = False) -> list[dict]:
    """Eager timings (launches included: at small T they bound all configs alike)."""
    results, default_out = [], call()
    for cfg in sweep_configs(t, fp8):
        try:
            err = rel_err(call(config=cfg), default_out)
            ms = timer(lambda cfg=cfg: call(config=cfg), iters)
        except Exception as exc:  # e.g. a tile that needs more shared memory than there is
            print(f"    skip {cfg}: {type(exc).__name__}")
            continue
        if err > 1e-2:  # tiles change only the order of fp32 sums; more means a broken config
            print(f"    WRONG ({err:.1e} from the default) {cfg}")
            continue
        results.append(dict(config=repr(cfg), ms=ms))
    results.sort(key=lambda r: r["ms"])
    for r in results[:3]:
        print(f"    {r['ms']:.4f} ms ({default_ms / r['ms']:.2f}x default)  {r['config']}")
    return results


@pytest.mark.parametrize("num_tokens", [1, 256, 8192])
def test_route_kernel_matches_torch_routing(num_tokens: int) -> None:
    """The one-kernel router (CUDA) against the torch formula on the same bf16 logits: the same
    probabilities picked (bf16 logits tie often, and a tie may be broken either way), the same
    renormalised weights."""
    torch.manual_seed(num_tokens)
    logits = torch.randn(num_tokens, E, device="cuda", dtype=torch.bfloat16)
    weights, ids = route(logits, TOP_K, True)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    want_p, want_ids = torch.topk(probs, TOP_K, dim=-1)
    got_p = probs.gather(1, ids)
    assert ids.dtype == torch.int64 and weights.dtype == torch.bfloat16
    torch.testing.assert_close(got_p, want_p, rtol=0, atol=0)  # descending, equal values
    # k distinct experts a row: with the equal values above, torch's top-k up to ties
    assert bool((ids.sort(-1).values.diff(dim=-1) > 0).all())
    print(f"ids equal to torch.topk's: {(ids == want_ids).float().mean().item():.4f}")
    want_w = (want_p / want_p.sum(-1, keepdim=True)).to(torch.bfloat16)
    torch.testing.assert_close(weights, want_w, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("extra", [[], ["--fp8"]], ids=["bf16", "fp8"])
def test_fused_moe(extra: list[str]) -> None:
    """Fused MoE within 1e-2 of fp32 (fp8: of the fp8 formula), graph replay equal to eager."""
    assert main(["--tokens", "1", "16", "64", "256", "1024", "4096", "--iters", "30", *extra]) == 0


if __name__ == "__main__":
    sys.exit(main())
