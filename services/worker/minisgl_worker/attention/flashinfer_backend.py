"""Attention through FlashInfer's paged wrappers (flashinfer-python, GPU only, imported lazily).

    "flashinfer": BatchPrefillWithPagedKVCacheWrapper(backend="fa2") for prefill/extend/mixed
                  steps; BatchDecodeWithPagedKVCacheWrapper for decode steps (tensor cores when
                  the GQA group is >= 4, where they win).
    "fa3":        the same wrappers with backend="fa3" (Hopper, sm_90), decode on tensor cores.
    "trtllm":     backend="trtllm-gen" kernels, Blackwell (sm_100+) only; refused elsewhere.

`plan` runs once per step in `prepare`, outside any CUDA graph, from the batch's host mirrors
(no device sync). K/V are written to the pool before the kernel (KVPool.store, one Triton kernel
on CUDA), unless the layer's fused prologue already wrote them at `store_loc()`.

CUDA graphs (decode): one decode wrapper per captured batch size, built with use_cuda_graph=True
over static indptr / indices / last-page-len buffers shared by all of them (graphs never run
concurrently); `prepare_for_replay` re-plans that wrapper, which refills the static buffers,
and copies the step's out_loc into a static buffer too: the KV store (ours or the layer's fused
one, which reads `store_loc()`) is captured in the graph.

Only fp16/bf16 activations and head_dim 64/128/256 (what FlashInfer 0.6.4 builds kernels for) are
accepted; anything else is refused with a ValueError when the backend is built, not inside a step.
An fp8 KV cache (e4m3/e5m2, scale 1.0) is read by the "flashinfer" (fa2) kernels, which upcast it
on load; "fa3" and "trtllm" want q in fp8 too and refuse it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from .base import AttentionBackend, BackendUnavailable, ForwardBatch, csr_page_layout

_WORKSPACE_BYTES = 256 * 1024 * 1024  # FlashInfer's split-K scratch (it recommends >= 128 MB)
# What FlashInfer 0.6.4's paged prefill/decode kernels are built for: other head sizes fail to
# JIT, and fp32 has no kernel at all (a KeyError deep inside plan()); refuse them at start-up.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as exc:
        raise BackendUnavailable(
            "FlashInfer attention needs the flashinfer-python package on a CUDA machine "
            f"({exc}); use --attention-backend triton or torch") from exc
    return flashinfer


_CUDA: bool | None = None


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """Uploads from pageable memory wait for the stream (a hidden host sync): pin them."""
    global _CUDA
    if _CUDA is None:  # is_available() asks the driver each call: once is enough
        _CUDA = torch.cuda.is_available()
    return t.pin_memory() if _CUDA else t


def paged_kv_layout(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page layout from the host mirrors: kv_indptr [B+1], kv_indices (the used
    prefix of each page-table row, concatenated), kv_last_page_len [B]; int32, pinned CPU.
    The engine's PlanBuilder ships these ready-made (`batch.kv_indptr_host`, ...); this is for
    batches built elsewhere (tests, the graph runner's own padding)."""
    seq = np.asarray(batch.seq_lens_host, dtype=np.int64)
    indptr, indices, last = csr_page_layout(seq, batch.page_table_host.numpy(), batch.page_size)
    return (_pinned(torch.from_numpy(indptr)), _pinned(torch.from_numpy(indices)),
            _pinned(torch.from_numpy(last)))


def _layout(batch: ForwardBatch, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_indptr host, kv_indices on the device, kv_last_page_len host) for plan()."""
    if (batch.kv_indptr_host is not None and batch.kv_indices is not None
            and batch.kv_last_page_len_host is not None):
        return batch.kv_indptr_host, batch.kv_indices, batch.kv_last_page_len_host
    indptr, indices, last = paged_kv_layout(batch)
    return indptr, indices.to(device, non_blocking=True), last


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True
    prefill_impl: ClassVar[str] = "fa2"
    decode_impl: ClassVar[str] = "fa2"  # used when the decode wrapper runs on tensor cores
    decode_tensor_cores: ClassVar[bool | None] = None  # None: by GQA group size
    workspace_bytes: ClassVar[int] = _WORKSPACE_BYTES
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = SUPPORTED_DTYPES
    supported_head_dims: ClassVar[tuple[int, ...]] = SUPPORTED_HEAD_DIMS
    supports_fp8_kv: ClassVar[bool] = True

    @classmethod
    def check_available(cls, device: torch.device) -> None:
        if device.type != "cuda":
            raise BackendUnavailable(f"attention backend {cls.name!r} needs a CUDA device")
        _import_flashinfer()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        c = self.config
        self._check_config()
        fi = self._fi = _import_flashinfer()
        self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=c.device)
        group = c.num_qo_heads // c.num_kv_heads
        tc = self.decode_tensor_cores
        # Tensor cores win for GQA groups >= 4, and for any group over an fp8 cache (whose
        # CUDA-core kernel is compute-bound; docs/benchmarks/log/2026-11-23-04.md).
        fp8 = c.cache_dtype in FP8_KV_DTYPES
        self._tensor_cores = (group >= 4 or fp8) if tc is None else tc
        self._prefill = fi.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend=self.prefill_impl)
        self._decode = self._new_decode_wrapper()
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._active: Any = None
        self._out_loc: torch.Tensor | None = None
        self._graph_out_loc = torch.zeros(0, dtype=torch.int64, device=c.device)

    def _check_config(self) -> None:
        c, name = self.config, self.name
        if c.dtype not in self.supported_dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in self.supported_dtypes)
            raise ValueError(
                f"attention backend {name!r} does not support dtype "
                f"{str(c.dtype).removeprefix('torch.')}; it supports {allowed} (use --dtype "
                f"bfloat16, or --attention-backend triton or torch)")
        kv = c.cache_dtype
        if kv != c.dtype and not (kv in FP8_KV_DTYPES and self.supports_fp8_kv):
            raise ValueError(
                f"attention backend {name!r} cannot read a {str(kv).removeprefix('torch.')} KV "
                f"cache with {str(c.dtype).removeprefix('torch.')} activations (use "
                f"--attention-backend flashinfer or triton, or --kv-cache-dtype auto)")
        if c.head_dim not in self.supported_head_dims:
            allowed = ", ".join(map(str, self.supported_head_dims))
            raise ValueError(
                f"attention backend {name!r} does not support head_dim {c.head_dim}; FlashInfer "
                f"kernels exist for head_dim {allowed} (use --attention-backend triton or torch)")

    def _new_decode_wrapper(self, bs: int = 0) -> Any:
        kwargs: dict[str, Any] = {"use_tensor_cores": self._tensor_cores}
        if self._tensor_cores:
            kwargs["backend"] = self.decode_impl
        if bs:
            assert self._graph_bufs is not None
            indptr, indices, last = self._graph_bufs
            kwargs.update(use_cuda_graph=True, paged_kv_indptr_buffer=indptr[: bs + 1],
                          paged_kv_indices_buffer=indices,
                          paged_kv_last_page_len_buffer=last[:bs])
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", **kwargs)

    def _plan_extra(self, batch: ForwardBatch) -> dict[str, Any]:
        """trtllm-gen kernels read a block table and lengths instead of the CSR layout; handing
        over ours spares FlashInfer a per-request Python loop that rebuilds them."""
        if self.prefill_impl != "trtllm-gen":
            return {}
        return {"block_tables": batch.page_table,
                "seq_lens": torch.tensor(batch.seq_lens_host, dtype=torch.int32)}

    def _plan_decode(self, wrapper: Any, batch: ForwardBatch) -> None:
        c = self.config
        indptr, indices, last = _layout(batch, c.device)
        wrapper.plan(indptr, indices, last, c.num_qo_heads,
                     c.num_kv_heads, c.head_dim, c.page_size, q_data_type=c.dtype,
                     kv_data_type=c.cache_dtype, sm_scale=c.scale, **self._plan_extra(batch))

    def prepare(self, batch: ForwardBatch) -> None:
        c = self.config
        self._out_loc = batch.out_loc
        if batch.is_decode:
            self._plan_decode(self._decode, batch)
            self._active = self._decode
            return
        indptr, indices, last = _layout(batch, c.device)
        qo_indptr = batch.qo_indptr_host
        if qo_indptr is None:
            qo_indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32)
            torch.cumsum(torch.tensor(batch.extend_lens_host, dtype=torch.int32), 0,
                         out=qo_indptr[1:])
            qo_indptr = _pinned(qo_indptr)
        # causal=True aligns each request's queries to the end of its KV: new token i sees the
        # cached prefix and new tokens up to itself, which is the extend semantics.
        self._prefill.plan(qo_indptr, indptr, indices, last,
                           c.num_qo_heads, c.num_kv_heads, c.head_dim, c.page_size,
                           causal=True, sm_scale=c.scale, q_data_type=c.dtype,
                           kv_data_type=c.cache_dtype, **self._plan_extra(batch))
        self._active = self._prefill

    def store_loc(self) -> torch.Tensor | None:
        return self._out_loc  # under CUDA graphs the static _graph_out_loc slice

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_stored: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self._active is None or self._out_loc is None:
            raise RuntimeError(f"{type(self).__name__}.forward before prepare")
        if not kv_stored:
            self.pool.store(layer_id, self._out_loc, k, v)
        return self._active.run(q, (self.pool.k[layer_id], self.pool.v[layer_id]))

    # -- CUDA graphs -----------------------------------------------------------------------------

    def init_cuda_graph(self, max_bs: int) -> None:
        c = self.config
        self._graph_bufs = (
            torch.zeros(max_bs + 1, dtype=torch.int32, device=c.device),
            torch.zeros(max_bs * c.max_pages_per_seq, dtype=torch.int32, device=c.device),
            torch.zeros(max_bs, dtype=torch.int32, device=c.device),
        )
        # The KV store inside the graph reads out_loc from the address seen at capture, so it
        # must be a static buffer refilled per replay, never the step's own (freed) tensor.
        self._graph_out_loc = torch.full((max_bs,), self.pool.dummy_page * c.page_size,
                                         dtype=torch.int64, device=c.device)

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        if self._graph_bufs is None:
            raise RuntimeError(f"{self.name}: init_cuda_graph must come before capture")
        bs = batch.batch_size
        if bs not in self._graph_wrappers:
            self._graph_wrappers[bs] = self._new_decode_wrapper(bs)
        self.prepare_for_replay(batch)

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        wrapper = self._graph_wrappers.get(batch.batch_size)
        if wrapper is None or not batch.is_decode:
            raise ValueError(f"no captured decode graph for batch size {batch.batch_size}")
        self._plan_decode(wrapper, batch)
        self._active = wrapper
        out_loc = self._graph_out_loc[: batch.batch_size]
        out_loc.copy_(batch.out_loc, non_blocking=True)
        self._out_loc = out_loc


class FA3Backend(FlashInferBackend):
    """FlashInfer's FlashAttention-3 kernels (Hopper)."""

    name = "fa3"
    prefill_impl = "fa3"
    decode_impl = "fa3"
    decode_tensor_cores = True
    supports_fp8_kv = False

    @classmethod
    def check_available(cls, device: torch.device) -> None:
        super().check_available(device)
        major, minor = torch.cuda.get_device_capability(device)
        if major != 9:
            raise BackendUnavailable(
                f"attention backend 'fa3' needs a Hopper GPU (sm_90); this one is "
                f"sm_{major}{minor}; use flashinfer or triton")


class TrtllmBackend(FlashInferBackend):
    """FlashInfer's TensorRT-LLM-generated kernels; they exist for Blackwell (sm_100+) only.
    Untested here (no Blackwell machine): no CUDA graphs until someone checks them on one."""

    name = "trtllm"
    supports_cuda_graph = False
    prefill_impl = "trtllm-gen"
    decode_impl = "trtllm-gen"
    decode_tensor_cores = True
    supports_fp8_kv = False

    @classmethod
    def check_available(cls, device: torch.device) -> None:
        super().check_available(device)
        major, minor = torch.cuda.get_device_capability(device)
        if major < 10:
            raise BackendUnavailable(
                f"attention backend 'trtllm' needs a Blackwell GPU (sm_100 or newer); this one "
                f"is sm_{major}{minor}; use flashinfer, fa3 (Hopper) or triton")
