"""GPU check of the attention backends (and the sampler's fused draw): accuracy, then speed.

    make test-gpu                        # as a pytest test (bf16 and fp8 caches), or with options:
    source bench/gpu_env.sh
    PYTHONPATH=tests:$PYTHONPATH python3 -m gpu.test_attention [--backends triton,flashinfer,fa3]
        [--page-sizes 16,1] [--json attn.json] [--tol 0.02] [--kv-cache-dtype fp8_e4m3]

Shapes are one TP rank of Llama-3-8B (32 query heads, 8 KV heads, head_dim 128), bf16, on a random
paged pool (pages scattered, garbage in unused slots). Each case is one `ForwardBatch` of W1's
interface: decode batches (ragged KV lengths) and extend batches (fresh prefills, chunks over a
cached prefix, prefills mixed with decode rows). For each backend: relative Frobenius error of
`prepare + forward` against the torch backend run in fp32 on an fp32 copy of the pool, the K/V it
wrote, and the median forward time (CUDA events; `prepare` timed apart). Decode cases are also
captured in a CUDA graph at a padded batch size (padded rows as the graph runner makes them) and
replayed; the replay must match too. Last, the sampler's Triton Gumbel draw is compared with its
torch reference (same hash bits -> same tokens) and both are timed. Exit status 1 on any failure.

With --kv-cache-dtype fp8_e4m3/fp8_e5m2 the pool is fp8 and every K/V value (cached and new) is
drawn fp8-representable, so the fp32 reference sees exactly what the cache holds and the check
measures the kernels' fp8 reads; the GPU stores' rounding (store_kv, the fused prologue) is then
compared byte for byte with torch's saturating cast.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from minisgl_worker.attention.base import (
    PLAIN,
    AttentionBackend,
    AttentionConfig,
    ForwardBatch,
    LayerAttention,
)
from minisgl_worker.attention.kv_pool import KVPool
from minisgl_worker.attention.torch_backend import TorchBackend
from minisgl_worker.config import KV_CACHE_DTYPES

HQ, HKV, D = 32, 8, 128
DEV = torch.device("cuda")
DECODE_CASES = [(1, 512), (1, 8192), (8, 2048), (64, 1024), (200, 700)]  # (batch, max KV len)
EXTEND_CASES = {  # name -> [(cached prefix, new tokens)]
    "prefill-1x2048": [(0, 2048)],
    "prefill-4-ragged": [(0, 300), (0, 1000), (0, 17), (0, 555)],
    "chunk-over-prefix": [(3000, 512), (128, 256)],
    "mixed-prefill+decode": [(0, 400), (700, 200)] + [(100 + 37 * i, 1) for i in range(30)],
}
GRAPH_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
# The layer's features (--window, --sinks): what every backend and the reference compute.
FEATURE: LayerAttention = PLAIN
SINKS: torch.Tensor | None = None  # [HQ] fp32 on the device when --sinks


def backend_class(name: str) -> type[AttentionBackend]:
    """By module, not through the registry, so a registry gap cannot hide a backend."""
    if name == "triton":
        from minisgl_worker.attention.triton_backend import TritonBackend as cls
    else:
        from minisgl_worker.attention import flashinfer_backend as fb

        cls = {"flashinfer": fb.FlashInferBackend, "fa3": fb.FA3Backend,
               "trtllm": fb.TrtllmBackend}[name]
    cls.check_available(DEV)
    return cls


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def time_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


class Case:
    """A random pool holding each request's cached prefix, and the step's q/k/v."""

    def __init__(self, reqs: list[tuple[int, int]], page_size: int, seed: int,
                 kv_dtype: torch.dtype = torch.bfloat16) -> None:
        gen = torch.Generator(device=DEV).manual_seed(seed)
        self.reqs, self.page_size = reqs, page_size
        pages_per = [-(-(c + n) // page_size) for c, n in reqs]
        self.num_pages = sum(pages_per) + 8
        self.max_pages = max(pages_per)
        shape = (self.num_pages + 1, page_size, HKV, D)
        self.k = torch.randn(shape, device=DEV, generator=gen)
        self.v = torch.randn(shape, device=DEV, generator=gen)
        order = torch.randperm(self.num_pages, device=DEV, generator=gen).to(torch.int32)
        self.table = torch.zeros(len(reqs), self.max_pages, dtype=torch.int32, device=DEV)
        used = 0
        for i, n in enumerate(pages_per):
            self.table[i, :n] = order[used : used + n]
            used += n
        t = sum(n for _, n in reqs)
        self.q = torch.randn(t, HQ, D, device=DEV, generator=gen)
        self.new_k = torch.randn(t, HKV, D, device=DEV, generator=gen)
        self.new_v = torch.randn(t, HKV, D, device=DEV, generator=gen)
        self.kv_dtype = kv_dtype
        if kv_dtype.itemsize == 1:  # fp8-representable values: the reference sees the cache
            for name in ("k", "v", "new_k", "new_v"):
                setattr(self, name, getattr(self, name).to(kv_dtype).float())

    def pool(self, dtype: torch.dtype) -> KVPool:
        pool = KVPool(1, self.num_pages, self.page_size, HKV, D, dtype, DEV, len(self.reqs),
                      self.max_pages)
        pool.k[0].copy_(self.k)
        pool.v[0].copy_(self.v)
        pool.page_table.copy_(self.table)
        return pool

    def config(self, dtype: torch.dtype, max_slots: int) -> AttentionConfig:
        kv = self.kv_dtype if dtype != torch.float32 else torch.float32
        return AttentionConfig(HQ, HKV, D, D**-0.5, self.page_size, max_slots, self.max_pages,
                               self.max_pages * self.page_size, dtype, DEV, kv_dtype=kv,
                               layers=(FEATURE,))

    def batch(self, pool: KVPool, pad_to: int = 0) -> ForwardBatch:
        cache = [c for c, _ in self.reqs]
        ext = [n for _, n in self.reqs]
        n_pad = max(0, pad_to - len(self.reqs))
        seq = [c + n for c, n in self.reqs] + [1] * n_pad
        cache, ext = cache + [0] * n_pad, ext + [1] * n_pad
        num_p = -(-max(seq) // self.page_size)
        table = pool.page_table[: len(self.reqs), :num_p]
        if n_pad:
            dummy = torch.full((n_pad, num_p), pool.dummy_page, dtype=torch.int32, device=DEV)
            table = torch.cat([table, dummy])
        pos = torch.cat([torch.arange(c, c + e) for c, e in zip(cache, ext, strict=True)])
        rows = torch.repeat_interleave(torch.arange(len(seq)), torch.tensor(ext))
        table_h = table.cpu()
        out_loc = table_h[rows, pos // self.page_size].long() * self.page_size
        out_loc += pos % self.page_size
        i32 = torch.int32
        return ForwardBatch(
            batch_size=len(seq), num_tokens=sum(ext), is_decode=all(e == 1 for e in ext),
            page_size=self.page_size, positions=pos.to(DEV), out_loc=out_loc.to(DEV),
            slots=torch.arange(len(seq), device=DEV),
            cache_lens=torch.tensor(cache, dtype=i32, device=DEV),
            extend_lens=torch.tensor(ext, dtype=i32, device=DEV),
            seq_lens=torch.tensor(seq, dtype=i32, device=DEV),
            qo_indptr=torch.tensor([0, *ext]).cumsum(0).to(i32).to(DEV), page_table=table,
            cache_lens_host=cache, extend_lens_host=ext, seq_lens_host=seq,
            page_table_host=table_h, max_seq_len=max(seq), max_extend_len=max(ext),
            sample_indices=torch.zeros(0, dtype=torch.int64, device=DEV))

    def padded_qkv(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        pad = n - self.q.shape[0]
        return tuple(torch.cat([t, torch.zeros(pad, *t.shape[1:], device=DEV)]).to(dtype)
                     for t in (self.q, self.new_k, self.new_v))


def reference(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    pool = case.pool(torch.float32)
    backend = TorchBackend(case.config(torch.float32, len(case.reqs)), pool)
    backend.prepare(case.batch(pool))
    out = backend.forward(case.q, case.new_k, case.new_v, 0, sinks=SINKS)
    return out, pool.k[0]


def check_backend(name: str, case: Case, ref: tuple[torch.Tensor, torch.Tensor],
                  tol: float) -> dict:
    dtype = torch.bfloat16
    pool = case.pool(case.kv_dtype)
    backend = backend_class(name)(case.config(dtype, len(case.reqs)), pool)
    batch = case.batch(pool)
    q, k, v = (t.to(dtype) for t in (case.q, case.new_k, case.new_v))
    backend.prepare(batch)
    out = backend.forward(q, k, v, 0, sinks=SINKS)
    rec = {"err": rel_err(out, ref[0]), "kv_err": rel_err(pool.k[0], ref[1])}
    rec["prepare_ms"] = time_ms(lambda: backend.prepare(batch), iters=10)
    backend.prepare(batch)
    rec["forward_ms"] = time_ms(lambda: backend.forward(q, k, v, 0, sinks=SINKS))
    ok = rec["err"] < tol and rec["kv_err"] < tol
    if batch.is_decode and backend.supports_cuda_graph:
        bs = next(s for s in GRAPH_SIZES if s >= batch.batch_size)
        backend.init_cuda_graph(bs)
        padded = case.batch(pool, pad_to=bs)
        gq, gk, gv = case.padded_qkv(bs, dtype)
        backend.prepare_for_capture(padded)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            backend.forward(gq, gk, gv, 0, sinks=SINKS)  # warm-up: compiles, plans, uncaptured
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out = backend.forward(gq, gk, gv, 0, sinks=SINKS)
        # Replay as the engine does: with a freshly built batch, after the captured one is gone
        # and its memory reused (a graph that kept reading the captured tensors fails here), and
        # with the new K/V rows poisoned so that the replay must write them again.
        del padded
        scratch = torch.full((1 << 22,), 2**40, dtype=torch.int64, device=DEV)
        fresh = case.batch(pool, pad_to=bs)
        pool.k[0].view(-1, *pool.k[0].shape[2:])[fresh.out_loc[: len(case.reqs)]] = float("nan")
        backend.prepare_for_replay(fresh)
        graph.replay()
        torch.cuda.synchronize()
        del scratch
        rec["graph_kv_err"] = rel_err(pool.k[0], ref[1])
        ok = ok and rec["graph_kv_err"] < tol
        rec["graph_err"] = rel_err(g_out[: len(case.reqs)], ref[0])
        rec["graph_ms"] = time_ms(graph.replay)
        ok = ok and rec["graph_err"] < tol
    rec["ok"] = ok
    return rec


def check_sampler() -> dict:
    from minisgl_worker.sampling import ops

    gen = torch.Generator(device=DEV).manual_seed(0)
    rec: dict = {}
    for batch in (1, 64, 256):
        vocab = 151936
        x = torch.randn(batch, vocab, device=DEV, generator=gen) * 3
        seeds = torch.randint(0, 2**62, (batch,), device=DEV, generator=gen)
        positions = torch.arange(batch, device=DEV)
        keys = ops.row_keys(seeds, positions)
        th = ops.token_hashes(vocab, DEV)
        a = ops.gumbel_argmax_torch(x, keys, th)
        b = ops.gumbel_argmax_triton(x, seeds, positions)
        rec[f"bs{batch}"] = {
            "mismatches": int((a != b).sum()),
            "torch_ms": time_ms(lambda x=x, k=keys, th=th: ops.gumbel_argmax_torch(x, k, th)),
            "triton_ms": time_ms(
                lambda x=x, s=seeds, p=positions: ops.gumbel_argmax_triton(x, s, p)),
        }
    # The whole Sampler.sample on a decode-sized batch: greedy, and a top-p/penalty mix.
    from minisgl_core.sampling import SamplingParams
    from minisgl_worker.sampling import Sampler

    vocab, batch = 151936, 64
    x = torch.randn(batch, vocab, device=DEV, generator=gen) * 3
    slots_h = list(range(batch))
    slots, positions = torch.arange(batch, device=DEV), torch.full((batch,), 100, device=DEV)
    for label, params in (("greedy", SamplingParams(temperature=0.0)),
                          ("top_p+penalties", SamplingParams(temperature=0.8, top_p=0.9,
                                                             repetition_penalty=1.1,
                                                             frequency_penalty=0.2))):
        sampler = Sampler(batch, vocab, DEV, eos_token_ids=[2], seed=0)
        for i in slots_h:
            sampler.set_slot(i, params, [5, 6, 7])
        rec[f"sample_bs{batch}_{label}_ms"] = time_ms(
            lambda s=sampler: s.sample(x, slots, positions, host_slots=slots_h))
    # Log rounding may flip an exact near-tie between the two; anything more is a bug.
    rec["ok"] = all(r["mismatches"] <= 1 for k, r in rec.items() if k.startswith("bs"))
    return rec


def check_fp8_store(kv_dtype: torch.dtype) -> dict:
    """store_kv and the fused prologue into an fp8 cache vs torch's cast of the same values
    (clamped to the type's range): the bytes must agree; values span past the range."""
    from minisgl_worker.kernels import fused_ops
    from minisgl_worker.kernels.store_kv import store_kv
    from minisgl_worker.layers.rotary import RotaryEmbedding

    gen = torch.Generator(device=DEV).manual_seed(1)
    t, ps = 4096, 16
    k = (torch.randn(t, HKV, D, device=DEV, generator=gen) * 100).to(torch.bfloat16)
    v = (torch.randn(t, HKV, D, device=DEV, generator=gen) * 100).to(torch.bfloat16)
    loc = torch.randperm(t, device=DEV, generator=gen)
    top = torch.finfo(kv_dtype).max
    want = [x.float().clamp(-top, top).to(kv_dtype).view(torch.uint8) for x in (k, v)]
    shape = (t // ps, ps, HKV, D)
    kc, vc = (torch.zeros(shape, dtype=kv_dtype, device=DEV) for _ in range(2))
    store_kv(kc, vc, k, v, loc)
    rec = {"store_kv_mismatch": sum(int((c.view(-1, HKV, D)[loc].view(torch.uint8) != w).sum())
                                    for c, w in zip((kc, vc), want, strict=True))}
    # The fused prologue without norms: k is rotated first, so compare with torch's cast of the
    # k it leaves in place (the rotated bf16 values); v goes through unchanged.
    qk = torch.randn(t, HQ, D, device=DEV, generator=gen).to(torch.bfloat16)
    kk = k.clone()
    rope = RotaryEmbedding(D, 8192, 1e6).to(DEV)
    pos = torch.randint(0, 8192, (t,), device=DEV, generator=gen)
    kc.zero_()
    vc.zero_()
    fused_ops.qk_norm_rope_store_(qk, kk, v, pos, rope.cos, rope.sin, kc, vc, loc)
    want_k = kk.float().clamp(-top, top).to(kv_dtype).view(torch.uint8)
    rec["prologue_mismatch"] = (
        int((kc.view(-1, HKV, D)[loc].view(torch.uint8) != want_k).sum())
        + int((vc.view(-1, HKV, D)[loc].view(torch.uint8) != want[1]).sum()))
    rec["ok"] = rec["store_kv_mismatch"] == 0 and rec["prologue_mismatch"] == 0
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="triton,flashinfer,fa3")
    p.add_argument("--page-sizes", default="16,1")
    p.add_argument("--tol", type=float, default=2e-2)
    p.add_argument("--json", default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_CACHE_DTYPES])
    p.add_argument("--window", type=int, default=0, help="a sliding-window layer of this size")
    p.add_argument("--sinks", action="store_true", help="with attention sinks")
    args = p.parse_args(argv)
    global FEATURE, SINKS
    FEATURE = LayerAttention(window=args.window or None, sinks=args.sinks)
    SINKS = (torch.randn(HQ, generator=torch.Generator().manual_seed(9)).to(DEV) * 2
             if args.sinks else None)
    kv_dtype = KV_CACHE_DTYPES.get(args.kv_cache_dtype, torch.bfloat16)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    print(f"device: {torch.cuda.get_device_name()}")
    results: dict = {}
    failed = False
    cases: list[tuple[str, list[tuple[int, int]]]] = []
    rng = torch.Generator().manual_seed(0)
    for bs, max_len in DECODE_CASES:
        lens = torch.randint(1, max_len + 1, (bs,), generator=rng).tolist()
        lens[0] = max_len
        cases.append((f"decode-bs{bs}-kv{max_len}", [(n - 1, 1) for n in lens]))
    cases += list(EXTEND_CASES.items())
    for ps in (int(s) for s in args.page_sizes.split(",")):
        for i, (cname, reqs) in enumerate(cases):
            case = Case(reqs, ps, seed=i, kv_dtype=kv_dtype)
            ref = reference(case)
            for name in args.backends.split(","):
                key = f"{name}/ps{ps}/{cname}"
                try:
                    rec = check_backend(name, case, ref, args.tol)
                except Exception as exc:  # report and go on: one broken backend is one finding
                    traceback.print_exc()
                    rec = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                results[key] = rec
                failed |= not rec["ok"]
                shown = {k: (f"{v:.3g}" if isinstance(v, float) and math.isfinite(v) else v)
                         for k, v in rec.items()}
                print(f"{key:48s} {shown}")
            del case, ref
            torch.cuda.empty_cache()
    if kv_dtype.itemsize == 1:
        results["fp8_store"] = rec = check_fp8_store(kv_dtype)
        print(f"fp8_store {rec}")
        failed |= not rec["ok"]
    try:
        results["sampler"] = check_sampler()
    except Exception as exc:
        traceback.print_exc()
        results["sampler"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(f"sampler {results['sampler']}")
    failed |= not results["sampler"]["ok"]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("FAILED" if failed else "all checks passed")
    return 1 if failed else 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_attention_backends(kv_cache_dtype: str) -> None:
    """Every backend, both page sizes, against the fp32 torch reference; graphs equal eager. An
    fp8 cache leaves fa3 out: it refuses fp8 K/V with bf16 activations by design (_check_config)."""
    backends = "triton,flashinfer,fa3" if kv_cache_dtype == "auto" else "triton,flashinfer"
    assert main(["--kv-cache-dtype", kv_cache_dtype, "--backends", backends]) == 0


@pytest.mark.parametrize(("window", "sinks"), [(128, True), (1024, False)])
def test_triton_windows_and_sinks(window: int, sinks: bool) -> None:
    """gpt-oss's layer kinds (window 128 with sinks) and Gemma 3's (window 1024), compiled."""
    args = ["--backends", "triton", "--window", str(window)] + (["--sinks"] if sinks else [])
    assert main(args) == 0


if __name__ == "__main__":
    sys.exit(main())
