"""The FlashInfer backend inside the real Engine, on CPU, with a torch stand-in for the GPU-only
`flashinfer` package and a CPU emulation of CUDA-graph capture/replay.

The stand-in follows FlashInfer 0.6.4's documented wrapper contract: the CSR page layout
(paged_kv_indptr / paged_kv_indices / paged_kv_last_page_len), causal queries aligned to the end
of the KV, and use_cuda_graph decode wrappers that copy plan() inputs into the static buffers
they were built over (fixed batch size, indices no longer than their buffer) and whose kernels
read those buffers when they run. Its attention is one registered op, so the graph emulation
below treats it like one kernel launch: replay re-runs it on the tensors seen at capture time.

The graph emulation (`_TapeGraphRunner`) records every aten op of the captured forward with the
very tensor objects it read and wrote, and replays exactly those ops: a tensor that the backend
swapped for a new one after capture is not seen by the replay, as on a GPU, where the graph reads
the old (freed, reused) address. The eager runner used elsewhere re-runs Python and cannot see
such bugs.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .driver import run_requests

# -- the flashinfer stand-in ---------------------------------------------------------------------


@torch.library.custom_op("minisgl_test_fi::paged_attention", mutates_args=())
def _paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     last_page_len: torch.Tensor, batch_size: int, causal: bool,
                     sm_scale: float) -> torch.Tensor:
    """Batched paged attention over the CSR layout; reads every index from the tensors it is
    given when it runs (a kernel reading device memory), checks them like a bounds-checked
    gather would."""
    ps, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    num_pages = k_cache.shape[0]
    for b in range(batch_size):
        p0, p1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
        pages = kv_indices[p0:p1].long()
        if len(pages) == 0 or int(pages.min()) < 0 or int(pages.max()) >= num_pages:
            raise IndexError(f"request {b}: page ids {pages.tolist()} outside [0, {num_pages})")
        kv_len = (len(pages) - 1) * ps + int(last_page_len[b])
        t = torch.arange(kv_len)
        k = k_cache[pages[t // ps], t % ps].float().repeat_interleave(group, dim=1)
        v = v_cache[pages[t // ps], t % ps].float().repeat_interleave(group, dim=1)
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * sm_scale
        if causal:
            q_pos = kv_len - (q1 - q0) + torch.arange(q1 - q0)
            s = s.masked_fill(t[None, :] > q_pos[:, None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
    return out


class _Wrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.is_cuda_graph_enabled = use_cuda_graph
        self.plans = 0
        self._plan: tuple | None = None

    def _set_plan(self, qo_indptr, indptr, indices, last, hq, hkv, d, ps, causal, sm_scale,
                  q_data_type, kv_data_type):
        assert indptr.dtype == indices.dtype == last.dtype == torch.int32
        assert len(indices) >= int(indptr[-1]) and ((last >= 1) & (last <= ps)).all()
        assert q_data_type in (torch.float16, torch.bfloat16, torch.float32)  # fp32: see tests
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # an fp8 cache is read with any q dtype
        assert (kv_data_type == q_data_type or kv_data_type in fp8) and hq % hkv == 0
        batch_size = len(last)
        if self.is_cuda_graph_enabled:  # 0.6.4: plan() refills the buffers the kernels read
            if batch_size != self._fixed_batch_size:
                raise ValueError("The batch size should be fixed in cudagraph mode")
            if len(indices) > len(self._paged_kv_indices_buf):
                raise ValueError("The size of indices should be less than or equal to the "
                                 "allocated buffer")
            self._paged_kv_indptr_buf.copy_(indptr)
            self._paged_kv_indices_buf[: len(indices)].copy_(indices)
            self._paged_kv_last_page_len_buf.copy_(last)
        else:
            self._paged_kv_indptr_buf = indptr.clone()
            self._paged_kv_indices_buf = indices.clone()
            self._paged_kv_last_page_len_buf = last.clone()
        self._qo_indptr_buf = qo_indptr.clone()
        self._plan = (batch_size, causal, sm_scale, (hq, hkv, d, ps, q_data_type, kv_data_type))
        self.plans += 1

    def run(self, q, paged_kv_cache, *args, out=None, lse=None, return_lse=False):
        assert self._plan is not None, "run before plan"
        batch_size, causal, sm_scale, (hq, hkv, d, ps, dtype, kv_dtype) = self._plan
        k_cache, v_cache = paged_kv_cache
        assert q.shape[1:] == (hq, d) and k_cache.shape[1:] == (ps, hkv, d)
        assert q.dtype == dtype and k_cache.dtype == v_cache.dtype == kv_dtype
        return _paged_attention(q, k_cache, v_cache, self._qo_indptr_buf,
                                self._paged_kv_indptr_buf, self._paged_kv_indices_buf,
                                self._paged_kv_last_page_len_buf, batch_size, causal, sm_scale)


class _Decode(_Wrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph)
        if use_cuda_graph:
            bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                    paged_kv_last_page_len_buffer)
            assert all(torch.is_tensor(b) and b.dtype == torch.int32 for b in bufs)
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            assert len(paged_kv_indptr_buffer) == self._fixed_batch_size + 1
            (self._paged_kv_indptr_buf, self._paged_kv_indices_buf,
             self._paged_kv_last_page_len_buf) = bufs

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
             q_data_type="float16", kv_data_type=None, data_type=None, sm_scale=None,
             rope_scale=None, rope_theta=None, non_blocking=True, block_tables=None,
             seq_lens=None, fixed_split_size=None, disable_split_kv=False):
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._set_plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                       head_dim, page_size, False, sm_scale, q_data_type, kv_data_type)


class _Prefill(_Wrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend="auto", jit_args=None):
        assert not use_cuda_graph, "the engine never graphs prefill"
        super().__init__(float_workspace_buffer, kv_layout, False)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             **kwargs):
        assert qo_indptr.dtype == torch.int32 and qo_indptr.device.type == "cpu"
        self._set_plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                       num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, sm_scale,
                       q_data_type, kv_data_type)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """The stand-in as `flashinfer`, and FlashInferBackend allowed on CPU in fp32 (the stand-in
    computes in fp32, so greedy tokens can be compared with the torch backend exactly)."""
    from minisgl_worker import attention
    from minisgl_worker.attention import flashinfer_backend as fb

    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_Decode,
                                 BatchPrefillWithPagedKVCacheWrapper=_Prefill)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setitem(attention._REGISTRY, "flashinfer",
                        ("flashinfer_backend", "FlashInferBackend", False))
    monkeypatch.setattr(fb.FlashInferBackend, "workspace_bytes", 1024)
    monkeypatch.setattr(fb.FlashInferBackend, "check_available", classmethod(lambda c, d: None))
    monkeypatch.setattr(fb.FlashInferBackend, "supported_dtypes",
                        (*fb.FlashInferBackend.supported_dtypes, torch.float32))
    return fb


# -- CUDA graphs on a CPU: capture = record the ops, replay = re-run them on the same tensors -----


class _Tape(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for old, fresh in zip(tree_leaves(out), tree_leaves(new), strict=True):
                # Kernels write where they wrote at capture: fresh results go to the old tensors.
                if torch.is_tensor(old) and old.numel() and old.data_ptr() != fresh.data_ptr():
                    old.copy_(fresh)


def _tape_runner(model, backend, pool, max_bs, logits=None):
    from minisgl_worker.engine.cuda_graph import CudaGraphRunner, _empty_decode_batch, pad_decode_batch

    class _TapeGraphRunner(CudaGraphRunner):
        def _capture_all(self) -> None:
            self._tapes: dict[int, _Tape] = {}
            empty = _empty_decode_batch(self.device, self.pool.page_size)
            for bs in reversed(self.sizes):
                self.backend.prepare_for_capture(pad_decode_batch(empty, bs, self.pool.dummy_page))
                tape = self._tapes[bs] = _Tape()
                with tape:
                    self._outputs[bs] = self.model(self.input_ids[:bs], self.positions[:bs],
                                                   self.backend)

        def _forward(self, bs: int) -> torch.Tensor:
            self._tapes[bs].replay()
            return self._outputs[bs]

    return _TapeGraphRunner(model, backend, pool, max_bs, eager=True, logits=logits)


# -- the engine, end to end ----------------------------------------------------------------------

PS = 4


def _engine(path, backend: str, kv_cache_dtype: str = "auto"):
    from minisgl_worker.engine import Engine, EngineConfig

    return Engine(EngineConfig(model_path=str(path), attention_backend=backend, dtype="float32",
                               page_size=PS, max_slots=6, num_pages=160, max_model_len=128,
                               kv_cache_dtype=kv_cache_dtype,
                               hf_overrides={"num_hidden_layers": 2}))


def _workload() -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(0)
    lens = [9, 30, 5, 17, 22]
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in lens]
    return prompts, [0, 0, 3, 6, 9]  # staggered arrivals: decode batches of 2, 3, 4, 5 rows


@pytest.fixture(scope="module")
def torch_tokens(tiny_model_path) -> list[list[int]]:
    prompts, starts = _workload()
    return run_requests(_engine(tiny_model_path, "torch"), prompts, max_new=24, page_size=PS,
                        chunk=8, starts=starts)


def test_engine_with_graphs_matches_torch(tiny_model_path, torch_tokens, fake_flashinfer):
    """Chunked prefills next to decodes, decode batches changing size across the captured sizes
    (1, 2, 4; 3 rows padded to 4; 5 rows past the largest graph run eagerly), sequences spanning
    up to 14 pages, overlap on: the same greedy tokens as the torch backend. Regression: the KV
    store inside the graph read a capture-time out_loc tensor (an index-out-of-bounds device
    assert on an H100 once its memory was reused)."""
    engine = _engine(tiny_model_path, "flashinfer")
    runner = _tape_runner(engine.model, engine.backend, engine.pool, max_bs=4)
    assert runner.sizes == [1, 2, 4]
    engine.graph_runner = runner  # the engine builds one only on CUDA
    prompts, starts = _workload()
    got = run_requests(engine, prompts, max_new=24, page_size=PS, chunk=8, starts=starts)
    assert got == torch_tokens
    graph_plans = {bs: w.plans for bs, w in engine.backend._graph_wrappers.items()}
    assert graph_plans[2] > 1 and graph_plans[4] > 1  # replayed (each also planned at capture)
    assert engine.backend._decode.plans > 0  # decode batches of 5 rows ran without a graph


def test_engine_with_graphs_computing_logits_matches_torch(tiny_model_path, torch_tokens,
                                                            fake_flashinfer):
    """As the engine builds its runner on CUDA: the LM head inside the graph, so replays return
    logits; decode batches come padded from the PlanBuilder and the sampler reads the leading
    rows (or gathers them, when a one-token prefill chunk in the batch does not sample)."""
    engine = _engine(tiny_model_path, "flashinfer")
    model = engine.model
    runner = _tape_runner(model, engine.backend, engine.pool, max_bs=4,
                          logits=lambda h: model.compute_logits(h, fp32=False))
    assert runner.returns_logits
    engine.graph_runner = runner
    prompts, starts = _workload()
    got = run_requests(engine, prompts, max_new=24, page_size=PS, chunk=8, starts=starts)
    assert got == torch_tokens
    assert runner.replays > 0


def test_fp8_kv_cache_with_graphs_matches_torch(tiny_model_path, fake_flashinfer):
    """An fp8 KV cache: FlashInfer is planned with kv_data_type fp8 and reads the fp8 pool the
    model's stores wrote; the torch backend over its own fp8 pool gives the same greedy tokens
    (both upcast the same stored values), and they differ from the fp32 cache's logits."""
    prompts, starts = _workload()
    ref = _engine(tiny_model_path, "torch", "fp8_e4m3")
    want = run_requests(ref, prompts, max_new=24, page_size=PS, chunk=8, starts=starts)
    engine = _engine(tiny_model_path, "flashinfer", "fp8_e4m3")
    assert engine.pool.k[0].dtype == torch.float8_e4m3fn
    engine.graph_runner = _tape_runner(engine.model, engine.backend, engine.pool, max_bs=4)
    got = run_requests(engine, prompts, max_new=24, page_size=PS, chunk=8, starts=starts)
    assert got == want
    assert engine.backend._graph_wrappers[4].plans > 1


def test_engine_without_graphs_matches_torch(tiny_model_path, torch_tokens, fake_flashinfer):
    engine = _engine(tiny_model_path, "flashinfer")
    prompts, starts = _workload()
    got = run_requests(engine, prompts, max_new=24, page_size=PS, chunk=8, starts=starts)
    assert got == torch_tokens


# -- start-up refusals -----------------------------------------------------------------------------


def test_refuses_unsupported_dtype_and_head_dim(monkeypatch):
    from minisgl_worker.attention import flashinfer_backend as fb
    from minisgl_worker.attention.base import AttentionConfig
    from minisgl_worker.attention.kv_pool import KVPool

    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_Decode,
                                 BatchPrefillWithPagedKVCacheWrapper=_Prefill)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(fb.FlashInferBackend, "workspace_bytes", 1024)

    def make(head_dim: int, dtype: torch.dtype, cls=fb.FlashInferBackend):
        cpu = torch.device("cpu")
        cfg = AttentionConfig(4, 2, head_dim, head_dim**-0.5, 4, 2, 4, 16, dtype, cpu)
        return cls(cfg, KVPool(1, 4, 4, 2, head_dim, dtype, cpu, 2, 4))

    with pytest.raises(ValueError, match=r"float32.*float16, bfloat16"):
        make(64, torch.float32)
    for cls in (fb.FlashInferBackend, fb.FA3Backend, fb.TrtllmBackend):
        with pytest.raises(ValueError, match=r"head_dim 96.*64, 128, 256"):
            make(96, torch.bfloat16, cls)
    assert make(128, torch.bfloat16).name == "flashinfer"
    cpu = torch.device("cpu")
    for cls, ok in ((fb.FlashInferBackend, True), (fb.FA3Backend, False),
                    (fb.TrtllmBackend, False)):
        cfg = AttentionConfig(4, 2, 128, 128**-0.5, 4, 2, 4, 16, torch.bfloat16, cpu,
                              kv_dtype=torch.float8_e4m3fn)
        pool = KVPool(1, 4, 4, 2, 128, torch.float8_e4m3fn, cpu, 2, 4)
        if ok:
            assert cls(cfg, pool).config.cache_dtype == torch.float8_e4m3fn
        else:
            with pytest.raises(ValueError, match=r"float8_e4m3fn KV cache"):
                cls(cfg, pool)
