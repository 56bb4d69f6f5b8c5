"""How SelfAttention hands the KV store to its fused prologue kernel: every backend's
`store_loc()` (the static buffer under CUDA graphs: a captured kernel keeps the address it saw),
`forward(..., kv_stored=True)` skipping the backend's own store, the hybrid's routing, and whole
engines with the layers' Triton paths forced on (no GPU here: the interpreter runs them)."""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import sys  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_worker.attention import HybridBackend  # noqa: E402
from minisgl_worker.attention.torch_backend import TorchBackend  # noqa: E402
from minisgl_worker.attention.triton_backend import TritonBackend  # noqa: E402
from minisgl_worker.kernels import fused_ops  # noqa: E402

from .driver import run_requests  # noqa: E402
from .test_triton_backend import CFG, make_batch, make_pool, qkv  # noqa: E402

DECODE = [(1, 10, 1), (4, 3, 1)]
MIXED = [(1, 0, 6), (3, 5, 3)]


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """FlashInferBackend on CPU over test_flashinfer_engine's torch stand-in for flashinfer."""
    from minisgl_worker.attention import flashinfer_backend as fb

    from .test_flashinfer_engine import _Decode, _Prefill

    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_Decode,
                                 BatchPrefillWithPagedKVCacheWrapper=_Prefill)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(fb.FlashInferBackend, "workspace_bytes", 1024)
    monkeypatch.setattr(fb.FlashInferBackend, "supported_dtypes", (torch.float32,))
    monkeypatch.setattr(fb.FlashInferBackend, "supported_head_dims", (CFG.head_dim,))
    return fb


def _backends(fb: types.ModuleType | None) -> list:
    kinds = [TritonBackend] + ([fb.FlashInferBackend] if fb is not None else [])
    return [cls(CFG, make_pool(0)) for cls in kinds]


def test_store_loc_is_the_step_out_loc_then_the_graph_static_buffer(fake_flashinfer) -> None:
    for backend in _backends(fake_flashinfer):
        assert backend.store_loc() is None  # before any step: nothing to store into
        batch = make_batch(backend.pool, MIXED)
        backend.prepare(batch)
        assert backend.store_loc() is batch.out_loc
        backend.init_cuda_graph(4)
        static = (backend._graph.out_loc if isinstance(backend, TritonBackend)
                  else backend._graph_out_loc)
        for prepare in (backend.prepare_for_capture, backend.prepare_for_replay):
            batch = make_batch(backend.pool, DECODE, pad_to=4)
            prepare(batch)
            loc = backend.store_loc()
            assert loc is not None and loc.data_ptr() == static.data_ptr()  # same address
            assert torch.equal(loc, batch.out_loc) and loc is not batch.out_loc


def test_hybrid_routes_store_loc_and_kv_stored(fake_flashinfer) -> None:
    pool = make_pool(0)
    prefill, decode = TorchBackend(CFG, pool), fake_flashinfer.FlashInferBackend(CFG, pool)
    hybrid = HybridBackend(prefill, decode)
    hybrid.init_cuda_graph(4)
    batch = make_batch(pool, MIXED)
    hybrid.prepare(batch)
    assert hybrid.store_loc() is batch.out_loc
    hybrid.prepare_for_capture(make_batch(pool, DECODE, pad_to=4))
    assert hybrid.store_loc().data_ptr() == decode._graph_out_loc.data_ptr()
    q, k, v = qkv(4, seed=0)
    before = pool.k[0].clone(), pool.v[0].clone()
    hybrid.forward(q, k, v, 0, kv_stored=True)
    assert torch.equal(pool.k[0], before[0]) and torch.equal(pool.v[0], before[1])
    hybrid.forward(q, k, v, 0)
    assert not torch.equal(pool.k[0], before[0])


@pytest.mark.parametrize("cls", [TorchBackend, TritonBackend, "flashinfer"])
def test_kv_stored_skips_the_store_and_reads_the_cache(cls, fake_flashinfer) -> None:
    """A caller that stored K/V at store_loc() gets the same attention as a backend storing
    them itself, and the backend writes nothing more."""
    cls = fake_flashinfer.FlashInferBackend if cls == "flashinfer" else cls
    pools = [make_pool(2), make_pool(2)]
    outs = []
    for i, pool in enumerate(pools):
        backend = cls(CFG, pool)
        batch = make_batch(pool, MIXED)
        backend.prepare(batch)
        q, k, v = qkv(batch.num_tokens, seed=4)
        if i == 0:
            outs.append(backend.forward(q, k, v, 1))
            continue
        loc = backend.store_loc()
        pool.k_flat(1)[loc], pool.v_flat(1)[loc] = k, v
        after_store = pool.k[1].clone(), pool.v[1].clone()
        # k/v handed over as garbage: a backend that stored them anyway would be caught
        outs.append(backend.forward(q, torch.zeros_like(k), torch.zeros_like(v), 1,
                                    kv_stored=True))
        assert torch.equal(pool.k[1], after_store[0]) and torch.equal(pool.v[1], after_store[1])
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)
    for a, b in zip(pools[0].k + pools[0].v, pools[1].k + pools[1].v, strict=True):
        assert torch.equal(a, b)


# -- whole engines, the layers' Triton kernels forced on ----------------------------------------

PROMPTS = [[(7 * i + 3) % 4000 for i in range(13)], [(11 * i + 5) % 4000 for i in range(6)],
           [1, 2, 3]]
PS = 4


def _engine(path, backend: str, graphs: bool):
    from minisgl_worker.engine import Engine, EngineConfig
    from minisgl_worker.engine.cuda_graph import CudaGraphRunner

    engine = Engine(EngineConfig(model_path=str(path), attention_backend=backend, page_size=PS,
                                 max_slots=4, num_pages=64, max_model_len=128,
                                 hf_overrides={"num_hidden_layers": 2}))
    if graphs:  # the graph runner's plumbing, replayed eagerly (the engine builds one on CUDA)
        engine.graph_runner = CudaGraphRunner(engine.model, engine.backend, engine.pool,
                                              max_bs=4, eager=True)
    return engine


def _run(engine) -> list[list[int]]:
    return run_requests(engine, PROMPTS, 6, PS, chunk=8, starts=[0, 0, 2])


@pytest.fixture(scope="module")
def torch_tokens(tiny_model_path) -> list[list[int]]:
    return _run(_engine(tiny_model_path, "torch", graphs=False))


@pytest.mark.parametrize("backend, graphs", [("triton", True), ("torch", False)])
def test_engine_fused_prologue_equals_unfused_kernels(tiny_model_path, torch_tokens,
                                                      monkeypatch, backend, graphs) -> None:
    """As on CUDA: every layer takes the fused prologue (prefill and, through the graph
    runner's static buffers, decode). Against the unfused Triton kernels the KV caches agree
    bit for bit after the whole workload; against the torch layers the greedy tokens agree."""
    monkeypatch.setattr(fused_ops, "usable", lambda x: True)
    calls = []
    real = fused_ops.qk_norm_rope_store_
    monkeypatch.setattr(fused_ops, "qk_norm_rope_store_",
                        lambda *a, **kw: (calls.append(a[8]), real(*a, **kw))[1])
    fused = _engine(tiny_model_path, backend, graphs)
    got = _run(fused)
    assert calls and got == torch_tokens
    if graphs:  # decode steps stored through the static buffer
        assert fused.graph_runner.replays > 0
        static = fused.backend._graph.out_loc
        assert any(loc.data_ptr() == static.data_ptr() for loc in calls)

    monkeypatch.setattr(type(fused.backend), "store_loc", lambda self: None)
    n = len(calls)
    unfused = _engine(tiny_model_path, backend, graphs)
    assert _run(unfused) == got and len(calls) == n  # no fused call this time
    for a, b in zip(fused.pool.k + fused.pool.v, unfused.pool.k + unfused.pool.v, strict=True):
        assert torch.equal(a, b)
