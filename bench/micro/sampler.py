"""GPU bench of the decode-step draw on bf16 logits: the old path against the one-pass kernel.

    source bench/gpu_env.sh && python -m bench.micro.sampler [--iters 200] [--sweep]

Old path (as before the change): the LM head's `.float()` copy of the logits, the division by the
temperature (and an argmax for greedy rows), then `_gumbel_argmax_kernel` over fp32. New path:
one kernel over the bf16 logits with the temperature applied inside (greedy rows: temperature 0),
or a bf16 argmax for an all-greedy batch. Vocabulary 151,936 (Qwen3), B in 1, 64, 256; each case
is CUDA-event timed (median over --iters, L2 flushed before each call unless --no-flush) and the
tokens of both paths compared; one JSON line per case. Before them, two exactness checks that
random logits cannot make: the kernel's division against torch's over every bf16 value, and rows
whose token hangs on the last bit of x / t; and each case compares, besides the tokens, every
block's best score of both kernels bit for bit. new_table_us times the kernel variant that loads
the per-token hashes from a table instead of computing them. --sweep also times the new kernel over
chunk counts, block sizes and both hash variants, to tune `default_num_chunks`. Exit status 1 on
any mismatch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from minisgl_core.sampling import SamplingParams
from minisgl_worker.kernels import sampling as kern
from minisgl_worker.sampling import Sampler
from minisgl_worker.sampling import ops as sampling_ops

VOCAB = 151_936
TEMPS = [0.6, 0.7, 0.1, 0.33, 1.3, 2.9]


class Timer:
    """Median per-call time in µs; L2 (50 MB on H100) flushed before every call by default, so
    the logits come from HBM as after a large LM head."""

    def __init__(self, flush: bool) -> None:
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if flush else None

    def __call__(self, fn: Callable[[], object], iters: int, warmup: int = 10) -> float:
        for _ in range(warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for s, e in zip(starts, ends, strict=True):
            if self.flush is not None:
                self.flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return 1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def old_num_chunks(batch: int) -> int:
    """The chunking the old path ran with (kept fixed here should the default be re-tuned)."""
    return max(1, min(triton.cdiv(VOCAB, 4096), triton.cdiv(512, batch)))


def old_draw(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor,
             positions: torch.Tensor, any_greedy: bool) -> torch.Tensor:
    x = logits.float()  # what the LM head returned
    greedy = temps <= 0
    greedy_tokens = x.argmax(dim=1) if any_greedy else None
    x = x / torch.where(temps > 0, temps, 1.0)[:, None]
    tokens = kern.gumbel_argmax(x, seeds, positions, old_num_chunks(x.shape[0]))
    return tokens if greedy_tokens is None else torch.where(greedy, greedy_tokens, tokens)


@triton.jit
def _div_probe(x_ptr, out_rn_ptr, out_plain_ptr, temp, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    tl.store(out_rn_ptr + offs, tl.math.div_rn(x, temp), mask=offs < n)
    tl.store(out_plain_ptr + offs, x / temp, mask=offs < n)


def _normal(x: torch.Tensor) -> torch.Tensor:
    return (x == 0) | (x.abs() >= 2.0**-126)


def check_division() -> dict:
    """The kernel's upcast + div_rn against torch's `.float() / t`, over every finite bf16 value
    and random fp32 ones; the plain Triton `/` is counted too (it need not round like torch).
    Subnormal inputs or quotients (|x| < 1.2e-38, whose score x / t - g is -g whatever they
    round to) are counted apart: a flush to zero there cannot change a token."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    every_bf16 = bits.view(torch.bfloat16).cuda()
    every_bf16 = every_bf16[torch.isfinite(every_bf16)]
    rand32 = torch.randn(1 << 20, device="cuda") * 10
    temps = TEMPS + torch.empty(58).uniform_(0.05, 3.0).tolist()
    rn = plain = subnormal = 0
    for x in (every_bf16, rand32):
        out_rn, out_plain = torch.empty(x.shape, device="cuda"), torch.empty(x.shape, device="cuda")
        for t in temps:
            t32 = float(torch.tensor(t, dtype=torch.float32))  # the sampler's tables are fp32
            _div_probe[(triton.cdiv(x.numel(), 1024),)](x, out_rn, out_plain, t32, x.numel(),
                                                        BLOCK=1024)
            want = x.float() / torch.tensor(t32, device="cuda")
            normal = _normal(x.float()) & _normal(want)
            rn += int(((out_rn != want) & normal).sum())
            plain += int(((out_plain != want) & normal).sum())
            subnormal += int(((out_rn != want) & ~normal).sum())
    return {"case": "division", "div_rn_mismatches": rn, "plain_div_mismatches": plain,
            "subnormal_mismatches": subnormal, "values": int(every_bf16.numel() + rand32.numel()),
            "temps": len(temps)}


def check_rounding_rows() -> dict:
    """Rows whose token hangs on the last bit of x / t (see test_division_rounds_like_torch):
    two adjacent huge fp32 logits, token 0 iff their quotients tie."""
    gen = torch.Generator().manual_seed(0)
    mismatches, rows = 0, 0
    for t in TEMPS:
        sign = torch.where(torch.rand(4096, generator=gen) < 0.5, 1.0, -1.0)
        v = (torch.rand(4096, generator=gen) + 1) * 1e30 * sign
        logits = torch.full((4096, 64), -math.inf)
        logits[:, 0], logits[:, 1] = v, torch.nextafter(v, torch.tensor(math.inf))
        logits = logits.cuda()
        temps = torch.full((4096,), t, device="cuda")
        seeds, positions = torch.arange(4096, device="cuda"), torch.arange(4096, device="cuda")
        old = old_draw(logits, temps, seeds, positions, False)
        new = kern.gumbel_argmax(logits, seeds, positions, temps=temps)
        mismatches += int((old != new).sum())
        rows += 4096
    return {"case": "rounding_rows", "rows": rows, "mismatches": mismatches}


def scores_mismatch(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor,
                    positions: torch.Tensor) -> int:
    """Sampled rows compared at every block's best score (float32 bits), not only at the winning
    token: a one-ulp difference anywhere in the score (division, an FMA contraction of the
    noise) shows here, where random tokens would almost never notice it."""
    sampled = temps > 0
    x32 = logits.float() / torch.where(sampled, temps, 1.0)[:, None]
    chunks = triton.cdiv(VOCAB, kern._BLOCK)
    old_val, old_idx = kern.gumbel_partials(x32, seeds, positions, chunks)
    new_val, new_idx = kern.gumbel_partials(logits, seeds, positions, chunks, temps)
    return int(((old_val != new_val) | (old_idx != new_idx))[sampled].sum())


def make_case(batch: int, kind: str) -> tuple[torch.Tensor, ...]:
    logits = (torch.randn(batch, VOCAB, device="cuda") * 3).to(torch.bfloat16)
    temps = torch.full((batch,), 0.6, device="cuda")
    if kind == "mixed":
        temps[::2] = 0.0
    elif kind == "greedy":
        temps.zero_()
    seeds = torch.randint(0, 2**62, (batch,), device="cuda")
    positions = torch.randint(0, 4096, (batch,), device="cuda")
    return logits, temps, seeds, positions


def sampler_for(batch: int, kind: str) -> Sampler:
    s = Sampler(batch, VOCAB, torch.device("cuda"), seed=0)
    for i in range(batch):
        greedy = kind == "greedy" or (kind == "mixed" and i % 2 == 0)
        s.set_slot(i, SamplingParams(temperature=0.0 if greedy else 0.6))
    return s


def bench_case(batch: int, kind: str, timer: Timer, iters: int) -> dict:
    logits, temps, seeds, positions = make_case(batch, kind)
    any_greedy = kind != "temperature"
    if kind == "greedy":
        def old() -> torch.Tensor:
            return logits.float().argmax(dim=1)

        def new() -> torch.Tensor:
            return logits.argmax(dim=1)
    else:
        def old() -> torch.Tensor:
            return old_draw(logits, temps, seeds, positions, any_greedy)

        def new() -> torch.Tensor:
            return kern.gumbel_argmax(logits, seeds, positions, temps=temps)
    a, b = old(), new()
    mismatches = int((a != b).sum())
    scores = scores_mismatch(logits, temps, seeds, positions) if kind != "greedy" else 0
    old_us, new_us = timer(old, iters), timer(new, iters)
    table_us = None
    if kind != "greedy":  # the variant with the per-token hashes from a table
        table = sampling_ops.token_hash_table(VOCAB, torch.device("cuda"))

        def new_table() -> torch.Tensor:
            return kern.gumbel_argmax(logits, seeds, positions, temps=temps, tok_hash=table)
        mismatches += int((new_table() != b).sum())
        table_us = round(timer(new_table, iters), 1)
    # The whole new Sampler.sample as the engine calls it: its gathers and bookkeeping, and
    # any gap while the host issues them (the engine overlaps that with the next step).
    sampler = sampler_for(batch, kind)
    slots = torch.arange(batch, device="cuda")
    host_slots = list(range(batch))
    sampler_us = timer(lambda: sampler.sample(logits, slots, positions, host_slots), iters)
    gbytes = logits.numel() * logits.element_size() / 1e9
    return {"case": kind, "B": batch, "vocab": VOCAB, "dtype": "bf16", "old_us": round(old_us, 1),
            "new_us": round(new_us, 1), "new_table_us": table_us,
            "speedup": round(old_us / new_us, 2),
            "new_GBps": round(gbytes / (new_us * 1e-6), 1), "sampler_us": round(sampler_us, 1),
            "tokens_equal": mismatches == 0 and scores == 0, "mismatches": mismatches,
            "score_mismatches": scores}


def sweep(batch: int, timer: Timer, iters: int) -> list[dict]:
    logits, temps, seeds, positions = make_case(batch, "temperature")
    want = kern.gumbel_argmax(logits, seeds, positions, temps=temps)
    table = sampling_ops.token_hash_table(VOCAB, torch.device("cuda"))
    out = []
    for block, chunks, tok in itertools.product((512, 1024, 2048), (1, 2, 4, 8, 16, 32, 64, 128),
                                                (None, table)):
        if chunks > triton.cdiv(VOCAB, block):
            continue

        def fn(c: int = chunks, bl: int = block, t: torch.Tensor | None = tok) -> torch.Tensor:
            return kern.gumbel_argmax(logits, seeds, positions, c, temps=temps, block=bl,
                                      tok_hash=t)
        same = torch.equal(fn(), want)
        real = triton.cdiv(VOCAB, triton.cdiv(triton.cdiv(VOCAB, chunks), block) * block)
        out.append({"case": "sweep", "B": batch, "block": block, "num_chunks": real,
                    "tok_table": tok is not None, "programs": batch * real,
                    "us": round(timer(fn, iters), 1),
                    "default": chunks == kern.default_num_chunks(batch, VOCAB, block)
                    and block == kern._BLOCK and tok is None, "tokens_equal": same})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--no-flush", action="store_true", help="leave L2 warm between calls")
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench.micro.sampler: needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    timer = Timer(not args.no_flush)
    ok = True
    for rec in (check_division(), check_rounding_rows()):
        ok &= rec.get("div_rn_mismatches", 0) == 0 and rec.get("mismatches", 0) == 0
        print(json.dumps(rec), flush=True)
    for batch in args.batch:
        for kind in ("temperature", "mixed", "greedy"):
            rec = bench_case(batch, kind, timer, args.iters)
            ok &= rec["tokens_equal"]
            print(json.dumps(rec), flush=True)
        if args.sweep:
            for rec in sweep(batch, timer, max(20, args.iters // 4)):
                ok &= rec["tokens_equal"]
                print(json.dumps(rec), flush=True)
    print(json.dumps({"case": "summary", "device": torch.cuda.get_device_name(), "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
