"""Would two half-batches on two CUDA streams hide the decode GEMMs behind attention?

A Qwen3-0.6B bf16 decode step at batch 256 is ~73 % attention (bandwidth-bound, at its access
pattern's read speed) and ~17 % GEMMs (latency-bound: 28 µs a layer against a 10.5 µs weight
floor, docs/benchmarks.md tenth session). The halves of a batch are independent until sampling,
so one graph can run the forward of rows [0, B/2) on one stream and [B/2, B) on another: while
one half waits on its GEMMs the other can read KV. This measures the idea before building it:
a layer stack of the real kernels (residual RMSNorm, qkv, q-norm standing for the prologue, the
paged split-K decode of triton_kernels/paged_decode.py over a real paged pool, o, residual
RMSNorm, gate_up, SiLU-and-mul, down), one graph each way:

  one      the whole batch on one stream (what the engine does)
  halves   the two halves one after the other on one stream (the cost of splitting alone)
  streams  the two halves on two streams, joined at the end
  staggered  as streams, the second half started when the first issues its first decode kernel

    source bench/gpu_env.sh && python bench/gpu_bench_two_streams.py [--batch 256] [--layers 28]

One JSON line per batch size: µs per layer of each variant, and the attention and GEMM chains
timed alone. Outputs of `streams` and `halves` must equal `one` row for row (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "services" / "worker"))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_timing import graph_replay_ms  # noqa: E402
from minisgl_worker.kernels import fused_ops  # noqa: E402
from minisgl_worker.kernels.paged_decode import (  # noqa: E402
    choose_num_splits,
    paged_decode,
)

DEV, DTYPE, EPS, PAGE = "cuda", torch.bfloat16, 1e-6, 64
H, INTER, HQ, HKV, D = 1024, 3072, 16, 8, 128  # Qwen3-0.6B


class Stack:
    """`layers` layers of weights and a paged KV pool holding `batch` contexts."""

    def __init__(self, batch: int, layers: int, ctx: tuple[int, int], seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seq_lens = torch.randint(ctx[0], ctx[1] + 1, (batch,), generator=g)
        pages_each = (self.seq_lens + PAGE - 1) // PAGE
        total = int(pages_each.sum())
        perm = torch.randperm(total, generator=g)  # pages scattered over the pool
        table = torch.zeros(batch, int(pages_each.max()), dtype=torch.int32)
        at = 0
        for i, n in enumerate(pages_each.tolist()):
            table[i, :n] = perm[at:at + n]
            at += n
        self.page_table = table.to(DEV)
        self.seq_lens = self.seq_lens.to(DEV, torch.int32)
        self.max_len = int(self.seq_lens.max())
        self.k = [torch.randn(total, PAGE, HKV, D, device=DEV, dtype=DTYPE) for _ in range(layers)]
        self.v = [torch.randn(total, PAGE, HKV, D, device=DEV, dtype=DTYPE) for _ in range(layers)]
        self.w = [{"qkv": torch.randn((HQ + 2 * HKV) * D, H, device=DEV, dtype=DTYPE) * 0.02,
                   "o": torch.randn(H, HQ * D, device=DEV, dtype=DTYPE) * 0.02,
                   "gate_up": torch.randn(2 * INTER, H, device=DEV, dtype=DTYPE) * 0.02,
                   "down": torch.randn(H, INTER, device=DEV, dtype=DTYPE) * 0.02}
                  for _ in range(layers)]
        self.ln = torch.ones(H, device=DEV, dtype=DTYPE)
        self.qn = torch.ones(D, device=DEV, dtype=DTYPE)
        self.kv_bytes = int(self.seq_lens.sum()) * HKV * D * 2 * 2 * layers

    def forward(self, x: torch.Tensor, res: torch.Tensor, lo: int, hi: int,
                parts: str = "all", before_attention: Callable[[], None] | None = None
                ) -> torch.Tensor:
        """Rows [lo, hi) through every layer; res (their residual) is updated in place.
        parts: "all", "attention" (the decode kernel only) or "gemms" (everything else).
        before_attention runs once, just before the first layer's decode kernel is issued."""
        m = hi - lo
        rows = torch.arange(lo, hi, device=DEV, dtype=torch.int32) if parts != "gemms" else None
        splits = choose_num_splits(m, HKV, self.max_len)
        q = torch.randn(m, HQ, D, device=DEV, dtype=DTYPE) if parts == "attention" else None
        for layer, lw in enumerate(self.w):
            if parts == "attention":
                x = paged_decode(q, self.k[layer], self.v[layer], self.page_table, rows,
                                 self.seq_lens[lo:hi], D ** -0.5, splits)
                continue
            a = fused_ops.rmsnorm(x, self.ln, EPS, residual=res)
            qkv = F.linear(a, lw["qkv"])
            q = fused_ops.rmsnorm(qkv[:, : HQ * D].reshape(m, HQ, D), self.qn, EPS)
            if before_attention is not None and layer == 0:
                before_attention()
            if parts == "all":
                att = paged_decode(q, self.k[layer], self.v[layer], self.page_table, rows,
                                   self.seq_lens[lo:hi], D ** -0.5, splits)
            else:
                att = q
            o = F.linear(att.reshape(m, HQ * D), lw["o"])
            a = fused_ops.rmsnorm(o, self.ln, EPS, residual=res)
            x = F.linear(fused_ops.silu_and_mul(F.linear(a, lw["gate_up"])), lw["down"])
        return x


def measure(batch: int, layers: int, ctx: tuple[int, int], repeats: int) -> tuple[dict, bool]:
    st = Stack(batch, layers, ctx)
    half = batch // 2
    x0 = torch.randn(batch, H, device=DEV, dtype=DTYPE)
    res = torch.zeros(batch, H, device=DEV, dtype=DTYPE)
    out = torch.empty(batch, H, device=DEV, dtype=DTYPE)
    side = torch.cuda.Stream()

    def one() -> None:
        res.zero_()
        out.copy_(st.forward(x0, res, 0, batch))

    def halves() -> None:
        res.zero_()
        for lo, hi in ((0, half), (half, batch)):
            out[lo:hi].copy_(st.forward(x0[lo:hi], res[lo:hi], lo, hi))

    def streams() -> None:
        res.zero_()
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out[half:].copy_(st.forward(x0[half:], res[half:], half, batch))
        out[:half].copy_(st.forward(x0[:half], res[:half], 0, half))
        main.wait_stream(side)

    def staggered() -> None:
        """As streams, but the second half starts when the first reaches its first decode
        kernel, so one half's GEMMs can meet the other's attention instead of its GEMMs."""
        res.zero_()
        main = torch.cuda.current_stream()
        reached = torch.cuda.Event()
        side.wait_stream(main)
        out[:half].copy_(st.forward(x0[:half], res[:half], 0, half,
                                    before_attention=lambda: reached.record(main)))
        with torch.cuda.stream(side):
            side.wait_event(reached)
            out[half:].copy_(st.forward(x0[half:], res[half:], half, batch))
        main.wait_stream(side)

    rec: dict = {"batch": batch, "layers": layers, "ctx": list(ctx),
                 "kv_gb_per_step": round(st.kv_bytes / 1e9, 3)}
    outputs = {}
    for name, body in (("one", one), ("halves", halves), ("streams", streams),
                       ("staggered", staggered)):
        rec[f"{name}_us_per_layer"] = round(graph_replay_ms(body, repeats) * 1000 / layers, 2)
        body()
        torch.cuda.synchronize()
        outputs[name] = out.clone()
    for parts in ("attention", "gemms"):
        def alone(p: str = parts) -> None:
            res.zero_()
            st.forward(x0, res, 0, batch, p)
        rec[f"{parts}_alone_us_per_layer"] = round(graph_replay_ms(alone, repeats) * 1000 / layers, 2)
    rec["attention_tb_s"] = round(st.kv_bytes / layers / (rec["attention_alone_us_per_layer"]
                                                          * 1e-6) / 1e12, 2)
    for name in ("streams", "staggered"):
        rec[f"{name}_over_one"] = round(rec[f"{name}_us_per_layer"] / rec["one_us_per_layer"], 3)
    # Splitting changes the decode kernel's split count (and so its rounding) but not the rows'
    # arithmetic elsewhere: allow bf16-level differences only.
    ref = outputs["one"].float()
    scale = float(ref.abs().max())
    ok = True
    for name in ("halves", "streams", "staggered"):
        err = float((outputs[name].float() - ref).abs().max()) / scale
        rec[f"{name}_rel_err"] = round(err, 5)
        ok &= err < 0.1  # wrong rows or a race would be O(1)
    return rec, ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="256,128")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--ctx", default="200,2000", help="context lengths drawn uniformly")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lo, hi = (int(v) for v in args.ctx.split(","))
    all_ok = True
    for batch in (int(b) for b in args.batch.split(",")):
        rec, ok = measure(batch, args.layers, (lo, hi), args.repeats)
        all_ok &= ok
        line = json.dumps(rec)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
        torch.cuda.empty_cache()
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
