"""TritonBackend against the torch reference backend through W1's interface, on synthetic tensors
under the Triton interpreter: mixed prefill/extend steps, decode steps, and the CUDA-graph path
(static buffers, padded rows) driven on CPU."""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_worker.attention.base import (  # noqa: E402
    AttentionConfig,
    ForwardBatch,
    LayerAttention,
)
from minisgl_worker.attention.kv_pool import KVPool  # noqa: E402
from minisgl_worker.attention.torch_backend import TorchBackend  # noqa: E402
from minisgl_worker.attention.triton_backend import TritonBackend  # noqa: E402
from minisgl_worker.kernels import paged_decode, paged_extend, store_kv  # noqa: E402

for _mod in (paged_decode, paged_extend, store_kv):
    if not any(type(v).__name__ == "InterpretedFunction" for v in vars(_mod).values()):
        importlib.reload(_mod)

HQ, HKV, D, PS, LAYERS = 4, 2, 16, 4, 2
CFG = AttentionConfig(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, scale=D**-0.5,
                      page_size=PS, max_slots=6, max_pages_per_seq=8, max_model_len=32,
                      dtype=torch.float32, device=torch.device("cpu"))
# slot -> its pages (scattered, as the scheduler would hand them out)
PAGES = {1: [7, 2, 11, 4, 0], 3: [5, 9, 1, 13], 4: [3, 8, 12, 6]}


def make_pool(seed: int, dtype: torch.dtype = torch.float32) -> KVPool:
    pool = KVPool(LAYERS, 14, PS, HKV, D, dtype, torch.device("cpu"), 6, 8)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):  # garbage everywhere: cached prefixes and never-read slots
        pool.k[layer].copy_(torch.randn(pool.k[layer].shape, generator=gen))
        pool.v[layer].copy_(torch.randn(pool.v[layer].shape, generator=gen))
    for slot, pages in PAGES.items():
        pool.page_table[slot, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return pool


def make_batch(pool: KVPool, reqs: list[tuple[int, int, int]], pad_to: int = 0) -> ForwardBatch:
    """reqs: (slot, cache_len, extend_len). pad_to: pad a decode batch like the graph runner."""
    slots = [s for s, _, _ in reqs]
    cache = [c for _, c, _ in reqs]
    ext = [e for _, _, e in reqs]
    n_pad = max(0, pad_to - len(reqs))
    seq = [c + e for c, e in zip(cache, ext, strict=True)] + [1] * n_pad
    cache, ext = cache + [0] * n_pad, ext + [1] * n_pad
    num_p = -(-max(seq) // PS)
    table = pool.page_table[slots, :num_p]
    if n_pad:
        table = torch.cat([table, torch.full((n_pad, num_p), pool.dummy_page, dtype=torch.int32)])
    pos = torch.cat([torch.arange(c, c + e) for c, e in zip(cache, ext, strict=True)])
    rows = torch.repeat_interleave(torch.arange(len(seq)), torch.tensor(ext))
    out_loc = table[rows, pos // PS].long() * PS + pos % PS
    i32 = torch.int32
    return ForwardBatch(
        batch_size=len(seq), num_tokens=sum(ext), is_decode=all(e == 1 for e in ext),
        page_size=PS, positions=pos, out_loc=out_loc,
        slots=torch.tensor(slots + [0] * n_pad), cache_lens=torch.tensor(cache, dtype=i32),
        extend_lens=torch.tensor(ext, dtype=i32), seq_lens=torch.tensor(seq, dtype=i32),
        qo_indptr=torch.tensor([0, *ext]).cumsum(0).to(i32), page_table=table,
        cache_lens_host=cache, extend_lens_host=ext, seq_lens_host=seq,
        page_table_host=table.clone(), max_seq_len=max(seq), max_extend_len=max(ext),
        sample_indices=torch.zeros(0, dtype=torch.int64))


def qkv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, HQ, D, generator=gen), torch.randn(n, HKV, D, generator=gen),
            torch.randn(n, HKV, D, generator=gen))


def run_step(backends: list, pools: list[KVPool], reqs, seed: int, pad_to: int = 0,
             graph: bool = False, torch_store: bool = False) -> list[torch.Tensor]:
    """torch_store: K/V written by KVPool's torch path for every backend (forward with
    kv_stored=True), so that only the attention reads are compared."""
    outs = []
    for backend, pool in zip(backends, pools, strict=True):
        batch = make_batch(pool, reqs, pad_to)
        if graph:
            backend.prepare_for_replay(batch)
        else:
            backend.prepare(batch)
        q, k, v = qkv(sum(e for _, _, e in reqs), seed)
        pad = batch.num_tokens - q.shape[0]  # padded graph rows carry arbitrary values
        q, k, v = (torch.cat([t, torch.randn(pad, *t.shape[1:])]) for t in (q, k, v))
        if torch_store:
            for layer in range(LAYERS):
                pool.store(layer, batch.out_loc, k, v)
        outs.append(torch.stack([backend.forward(q, k, v, layer, kv_stored=torch_store)
                                 for layer in range(LAYERS)]))
    return outs


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_matches_torch_backend_over_prefill_extend_and_decode(kv_dtype):
    """Also over an fp8 KV cache, read upcast. The K/V stores are then the torch path's for both:
    the Triton interpreter does not round fp32 -> fp8 to nearest as torch and GPUs do (a GPU
    store is checked by tests/gpu/test_attention.py --kv-cache-dtype fp8_e4m3)."""
    fp8 = kv_dtype.itemsize == 1
    pools = [make_pool(0, kv_dtype), make_pool(0, kv_dtype)]
    cfg = CFG.__class__(**{**CFG.__dict__, "kv_dtype": kv_dtype})
    ref, tri = TorchBackend(cfg, pools[0]), TritonBackend(cfg, pools[1])
    steps = [
        [(1, 0, 6), (3, 5, 3)],  # a fresh prefill and an extend over a cached prefix
        [(1, 6, 1), (3, 8, 1)],  # decode
        [(4, 0, 9), (1, 7, 1), (3, 9, 4)],  # mixed: prefill chunk, decode row, extend
        [(4, 9, 1), (1, 8, 1), (3, 13, 1)],  # decode across a page boundary
    ]
    for i, reqs in enumerate(steps):
        expect, got = run_step([ref, tri], pools, reqs, seed=i, torch_store=fp8)
        torch.testing.assert_close(got, expect, atol=2e-5, rtol=2e-5)
        for layer in range(LAYERS):  # both wrote the same K/V, and only at out_loc
            assert torch.equal(pools[0].k[layer].view(torch.uint8),
                               pools[1].k[layer].view(torch.uint8))
            assert torch.equal(pools[0].v[layer].view(torch.uint8),
                               pools[1].v[layer].view(torch.uint8))


def test_windows_and_sinks_match_torch_backend_eager_and_graph():
    """Layer 0 windowed (3 tokens) with sinks, layer 1 windowed (6): prefill, extend, mixed and
    decode steps (eager, and padded through the CUDA-graph buffers) against the torch backend."""
    layers = (LayerAttention(window=3, sinks=True), LayerAttention(window=6))
    cfg = CFG.__class__(**{**CFG.__dict__, "layers": layers})
    sinks = [torch.tensor([0.5, -1.0, 2.0, 0.0]), None]
    pools = [make_pool(3), make_pool(3), make_pool(3)]
    ref, tri, graph = (TorchBackend(cfg, pools[0]), TritonBackend(cfg, pools[1]),
                       TritonBackend(cfg, pools[2]))
    graph.init_cuda_graph(4)
    steps = [[(1, 0, 6), (3, 5, 3)], [(1, 6, 1), (3, 8, 1)], [(4, 0, 9), (1, 7, 1), (3, 9, 4)],
             [(4, 9, 1), (1, 8, 1), (3, 13, 1)]]
    for i, reqs in enumerate(steps):
        outs = []
        for backend, pool in zip((ref, tri, graph), pools, strict=True):
            decode_graph = backend is graph and all(e == 1 for _, _, e in reqs)
            batch = make_batch(pool, reqs, pad_to=4 if decode_graph else 0)
            if decode_graph:
                backend.prepare_for_replay(batch)
            else:
                backend.prepare(batch)
            q, k, v = qkv(sum(e for _, _, e in reqs), seed=20 + i)
            pad = batch.num_tokens - q.shape[0]
            q, k, v = (torch.cat([t, torch.randn(pad, *t.shape[1:])]) for t in (q, k, v))
            outs.append(torch.stack([backend.forward(q, k, v, layer, sinks=sinks[layer])
                                     for layer in range(LAYERS)])[:, : q.shape[0] - pad])
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(outs[2], outs[0], atol=2e-5, rtol=2e-5)


def test_cuda_graph_path_with_padding():
    pools = [make_pool(1), make_pool(1)]
    ref, tri = TorchBackend(CFG, pools[0]), TritonBackend(CFG, pools[1])
    tri.init_cuda_graph(4)
    for i, reqs in enumerate([[(1, 10, 1), (4, 3, 1)], [(3, 2, 1)], [(1, 11, 1), (4, 4, 1)]]):
        expect = run_step([ref], pools[:1], reqs, seed=10 + i)[0]
        got = run_step([tri], pools[1:], reqs, seed=10 + i, pad_to=4, graph=True)[0]
        torch.testing.assert_close(got[:, : len(reqs)], expect[:, : len(reqs)],
                                   atol=2e-5, rtol=2e-5)
        for layer in range(LAYERS):  # padding wrote into the dummy page only
            live = pools[1].num_pages
            assert torch.equal(pools[0].k[layer][:live], pools[1].k[layer][:live])
    with pytest.raises(ValueError, match="decode"):
        tri.prepare_for_replay(make_batch(pools[1], [(1, 0, 3)]))


def test_eager_decode_equals_padded_graph_decode_bit_for_bit():
    """Eager decode cuts the KV into the same splits as the (padded) graph, so a CUDA-graph step
    and an eager step of the same batch give identical bits, not just close ones."""
    cfg = CFG.__class__(**{**CFG.__dict__, "max_model_len": 4096})  # decides the split count
    pools = [make_pool(2), make_pool(2)]
    eager, graph = TritonBackend(cfg, pools[0]), TritonBackend(cfg, pools[1])
    graph.init_cuda_graph(4)
    reqs = [(1, 17, 1), (4, 9, 1), (3, 13, 1)]
    got_eager = run_step([eager], pools[:1], reqs, seed=5)[0]
    got_graph = run_step([graph], pools[1:], reqs, seed=5, pad_to=4, graph=True)[0]
    assert eager._meta is not None and graph._meta is not None
    assert eager._meta.num_splits == graph._meta.num_splits > 1
    assert torch.equal(got_eager[:, :3], got_graph[:, :3])


# -- end to end through W1's engine on the embedded model --------------------------------------


def _generate(engine, steps: int = 5) -> list[list[int]]:
    """Two requests: one prefilled in two chunks (the second over a cached prefix), one in a
    single step next to it; then decode steps. Greedy, so tokens depend only on the logits."""
    from minisgl_core.sampling import SamplingParams
    from minisgl_core.step import DecodeEntries, ReqPlan, StepPlan

    sp = SamplingParams(temperature=0.0, max_tokens=16)
    a, b = list(range(5, 26)), list(range(300, 309))
    plans = [
        StepPlan(0, [ReqPlan(1, 0, 0, a[:12], 0, list(range(0, 8)), sample=False, sampling=sp)]),
        StepPlan(1, [ReqPlan(1, 0, 12, a[12:]),
                     ReqPlan(2, 3, 0, b, 0, list(range(8, 12)), sampling=sp)]),
    ]
    for i in range(steps):
        plans.append(StepPlan(2 + i, decodes=DecodeEntries([1, 2], [0, 3], [len(a) + i, len(b) + i],
                                                           [0, 0], [0, 0])))
    return [engine.step(p).token_ids for p in plans]


@pytest.fixture(scope="module")
def reference_tokens(tiny_model_path) -> list[list[int]]:
    from minisgl_worker.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model_path=str(tiny_model_path), attention_backend="torch",
                                 page_size=4, max_slots=4, kv_cache_tokens=64))
    tokens = _generate(engine)
    assert len(tokens) == 7 and all(len(t) == 2 for t in tokens[1:])
    return tokens


def test_engine_triton_with_graph_runner_matches_torch(tiny_model_path, reference_tokens):
    """Same greedy tokens as the torch backend. Prefill steps take the extend kernel; decode
    steps go through the CUDA-graph runner's plumbing (static buffers, padding to 4 rows, the
    backend's capture/replay hooks), replayed eagerly since there is no GPU here."""
    from minisgl_worker.engine import Engine, EngineConfig
    from minisgl_worker.engine.cuda_graph import CudaGraphRunner

    # max_model_len 300: graph decode runs with 2 fixed splits, the second empty for these rows.
    engine = Engine(EngineConfig(model_path=str(tiny_model_path), attention_backend="triton",
                                 page_size=4, max_slots=4, kv_cache_tokens=64, max_model_len=300))
    runner = CudaGraphRunner(engine.model, engine.backend, engine.pool, max_bs=4, eager=True)
    assert engine.backend._graph_splits(4) == 2
    assert runner.sizes == [1, 2, 4] and runner.graph_size(3) == 4
    engine.graph_runner = runner  # the engine builds one only on CUDA
    assert _generate(engine) == reference_tokens
    assert runner.replays == 5  # every decode step went through the runner


# -- FlashInferBackend's plumbing, with a stand-in for the GPU-only flashinfer package ----------
# The fake implements the wrappers' documented contract (CSR page layout, last_page_len, causal
# queries aligned to the end of the KV, use_cuda_graph wrappers reading their static buffers)
# in plain torch. The real kernels are checked on a GPU by tests/gpu/test_attention.py.


class _FakeWrapper:
    def __init__(self, workspace, layout, use_cuda_graph=False, use_tensor_cores=False,
                 backend="auto", paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None):
        assert layout == "NHD" and workspace.dtype == torch.uint8
        self.graph = use_cuda_graph
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                     paged_kv_last_page_len_buffer)
        self.plans = 0

    def _plan(self, qo_indptr, indptr, indices, last, hq, hkv, d, ps, causal, sm_scale):
        assert indptr.dtype == indices.dtype == last.dtype == torch.int32
        assert indptr.device.type == "cpu" and last.device.type == "cpu"  # host planning
        assert len(indices) == int(indptr[-1]) and ((last >= 1) & (last <= ps)).all()
        if self.graph:  # plan refills the static buffers that the captured kernels read
            b_ind, b_idx, b_last = self.bufs
            assert len(b_last) == len(last), "graph wrappers have a fixed batch size"
            b_ind.copy_(indptr)
            b_idx[: len(indices)].copy_(indices)
            b_last.copy_(last)
            indptr, indices, last = b_ind, b_idx, b_last
        self.p = (qo_indptr, indptr, indices, last, hq // hkv, ps, causal, sm_scale)
        self.plans += 1

    def run(self, q, kv):
        qo_indptr, indptr, indices, last, group, ps, causal, scale = self.p
        k_cache, v_cache = kv
        out = torch.empty_like(q)
        for b in range(len(last)):
            pages = indices[int(indptr[b]) : int(indptr[b + 1])].long()
            kv_len = (len(pages) - 1) * ps + int(last[b])
            t = torch.arange(kv_len)
            k = k_cache[pages[t // ps], t % ps].repeat_interleave(group, dim=1)
            v = v_cache[pages[t // ps], t % ps].repeat_interleave(group, dim=1)
            q0, q1 = (b, b + 1) if qo_indptr is None else (int(qo_indptr[b]), int(qo_indptr[b + 1]))
            s = torch.einsum("qhd,khd->hqk", q[q0:q1], k) * scale
            if causal:
                q_pos = kv_len - (q1 - q0) + torch.arange(q1 - q0)
                s = s.masked_fill(t[None, :] > q_pos[:, None], float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        return out


class _FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last, hq, hkv, d, ps, q_data_type, kv_data_type, sm_scale):
        self._plan(None, indptr, indices, last, hq, hkv, d, ps, False, sm_scale)


class _FakePrefill(_FakeWrapper):
    def plan(self, qo_indptr, indptr, indices, last, hq, hkv, d, ps, causal, sm_scale,
             q_data_type, kv_data_type):
        assert qo_indptr.dtype == torch.int32 and qo_indptr.device.type == "cpu"
        self._plan(qo_indptr, indptr, indices, last, hq, hkv, d, ps, causal, sm_scale)


def test_flashinfer_backend_plumbing(monkeypatch):
    import types

    from minisgl_worker.attention import flashinfer_backend as fb
    from minisgl_worker.attention.base import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="CUDA"):
        fb.FA3Backend.check_available(torch.device("cpu"))
    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_FakeDecode,
                                 BatchPrefillWithPagedKVCacheWrapper=_FakePrefill)
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", fake)
    monkeypatch.setattr(fb.FlashInferBackend, "workspace_bytes", 1024)
    # the stand-in computes in any dtype and head size; the real kernels refuse these at start-up
    monkeypatch.setattr(fb.FlashInferBackend, "supported_dtypes", (torch.float32,))
    monkeypatch.setattr(fb.FlashInferBackend, "supported_head_dims", (D,))
    pools = [make_pool(2), make_pool(2)]
    ref, fi = TorchBackend(CFG, pools[0]), fb.FlashInferBackend(CFG, pools[1])
    steps = [[(1, 0, 6), (3, 5, 3)], [(1, 6, 1), (3, 8, 1)], [(4, 0, 9), (1, 7, 1)]]
    for i, reqs in enumerate(steps):
        expect, got = run_step([ref, fi], pools, reqs, seed=20 + i)
        torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    fi.init_cuda_graph(4)
    for bs in (4, 2):
        fi.prepare_for_capture(make_batch(pools[1], [], pad_to=bs))
    for i, reqs in enumerate([[(1, 8, 1), (4, 9, 1), (3, 8, 1)], [(4, 10, 1)]]):
        expect = run_step([ref], pools[:1], reqs, seed=30 + i)[0]
        bs = 4 if len(reqs) > 2 else 2
        got = run_step([fi], pools[1:], reqs, seed=30 + i, pad_to=bs, graph=True)[0]
        torch.testing.assert_close(got[:, : len(reqs)], expect[:, : len(reqs)],
                                   atol=1e-5, rtol=1e-5)
    assert fi._graph_wrappers[4].plans == 2 and fi._graph_wrappers[2].plans == 2


def test_decode_programs_start_longest_first() -> None:
    """The decode kernel starts its programs longest row first: the order the engine uploaded
    with the step, else one sorted from the lengths (eagerly, and into the graph's buffer)."""
    backend = TritonBackend(CFG, make_pool(0))
    batch = make_batch(backend.pool, [(1, 10, 1), (3, 3, 1), (4, 12, 1)])
    backend.prepare(batch)
    assert backend._meta.order.tolist() == [2, 0, 1]
    backend.init_cuda_graph(4)
    backend.prepare_for_replay(make_batch(backend.pool, [(1, 10, 1), (3, 3, 1)], pad_to=4))
    assert backend._meta.order.tolist() == [0, 1, 2, 3]  # padding (seq_len 1) last
    assert backend._meta.order.data_ptr() == backend._graph.order.data_ptr()
    uploaded = make_batch(backend.pool, [(1, 10, 1), (3, 3, 1), (4, 12, 1)])
    uploaded.decode_order = torch.tensor([1, 2, 0], dtype=torch.int32)  # taken as given
    backend.prepare(uploaded)
    assert backend._meta.order is uploaded.decode_order


def test_start_up_prefills_reach_both_tiles_of_the_prefill_kernel(tiny_model_path,
                                                                   monkeypatch) -> None:
    """The start-up warm-up prefills 8 and 64 tokens, and the 64 span several pages when pages
    are smaller: both tiles of the Triton prefill kernel (16 rows, and 64 past 32 query tokens)
    run, and compile, before any request. Before, each warm-up prefill was cut to one page,
    and with pages of 16 the first prompt over 32 tokens compiled the larger tile."""
    from minisgl_worker.engine import Engine, EngineConfig

    seen: list[int] = []
    real = paged_extend.paged_extend
    monkeypatch.setattr(paged_extend, "paged_extend",
                        lambda *a, **kw: (seen.append(a[7]), real(*a, **kw))[1])
    engine = Engine(EngineConfig(model_path=str(tiny_model_path), attention_backend="triton",
                                 page_size=16, num_pages=32, max_slots=2,
                                 hf_overrides={"num_hidden_layers": 1}))
    try:
        assert sorted(set(seen)) == [8, 64]  # max query tokens of the warm-up's steps
        assert engine.builder.pages_len[0] == 0  # slot 0 handed back
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v2", "deepseek_v3"])
def test_engine_triton_serves_the_new_attention_kinds_like_hf(tiny_model, arch: str) -> None:  # noqa: ANN001
    """gpt-oss (alternating 8-token windows, sinks) and DeepSeek (latent attention) on the
    Triton backend: prefill chunks and decode steps give HF's logits."""
    from minisgl_core.step import ReqPlan, StepPlan
    from minisgl_worker.engine import Engine, EngineConfig

    from .driver import with_window_pages
    from .tiny_models import VOCAB, build_hf_model

    hf = build_hf_model(arch)
    seq = [(7 * i + 3) % VOCAB for i in range(24)]
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].float()
    engine = Engine(EngineConfig(model_path=str(tiny_model(arch)), page_size=4,
                                 num_pages=16, max_slots=2, attention_backend="triton"))
    pages = list(range(6))
    chunks = [(0, 5), (5, 14)] + [(i, i + 1) for i in range(14, len(seq))]
    for step, (lo, hi) in enumerate(chunks):
        req = ReqPlan(rid=0, slot=0, cache_len=lo, input_ids=seq[lo:hi],
                      new_pages=pages if step == 0 else [], sample=False)
        ours = engine.forward_logits(with_window_pages(engine, StepPlan(step, [req])))
        torch.testing.assert_close(ours, ref[lo:hi], atol=2e-4, rtol=1e-4)
    engine.close()


def test_window_pool_on_triton_with_graph_runner_matches_hf(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The sliding-window KV pool (12 window pages for 200-token sequences, window 8) on the
    Triton kernels: windowed layers store and read through the window table, eagerly and
    through the CUDA-graph runner's padded static buffers; greedy tokens equal HF's."""
    from minisgl_scheduler import Scheduler, SchedulerConfig
    from minisgl_worker.engine import Engine, EngineConfig
    from minisgl_worker.engine.cuda_graph import CudaGraphRunner

    from .test_window_pool import PS, WINDOW_PAGES, _hf_greedy, _model, _run
    from .tiny_models import VOCAB

    hf = _model(tmp_path)
    engine = Engine(EngineConfig(model_path=str(tmp_path), dtype="float32", page_size=PS,
                                 num_pages=128, max_slots=3, max_prefill_tokens=16,
                                 attention_backend="triton", window_pages=WINDOW_PAGES))
    assert engine.pool.window_layers and engine.backend.store_loc() is None
    runner = CudaGraphRunner(engine.model, engine.backend, engine.pool, max_bs=4, eager=True)
    engine.graph_runner = runner
    sched = Scheduler(engine, SchedulerConfig(max_prefill_tokens=16, max_step_ms=0.0))
    try:
        prompts = {1: [(5 * i + 1) % VOCAB for i in range(37)],
                   2: [(11 * i + 7) % VOCAB for i in range(21)],
                   3: [(3 * i + 5) % VOCAB for i in range(9)]}
        out = _run(sched, prompts, 60)
        for rid, prompt in prompts.items():
            assert out[rid][0] == _hf_greedy(hf, prompt, 60), rid
        assert runner.replays > 0
    finally:
        sched.close()
