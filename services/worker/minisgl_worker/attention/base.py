"""The attention-backend interface: what every backend (torch, triton, flashinfer, ...) implements.

Per step the engine builds one `ForwardBatch` from the `StepPlan` (on the host, uploaded in a few
copies) and calls, in this order:

    backend.prepare(batch)                 # once per step, never inside a CUDA graph
    for each layer: backend.forward(q, k, v, layer_id)   # inside the model forward

`forward` takes this step's projected, rotary-embedded tensors

    q: [T, num_qo_heads, head_dim]    k, v: [T, num_kv_heads, head_dim]   (heads per TP rank)

first writes k and v into the `KVPool` at `batch.out_loc` (flat slot = page * page_size + offset)
unless the caller already did (`kv_stored=True`, see below), then attends each query token to its
request's cached prefix plus the new tokens up to and including itself (causal), and returns
[T, num_qo_heads, head_dim] in q's dtype. Requests occupy contiguous token ranges in plan order:
request i owns tokens qo_indptr[i]:qo_indptr[i+1]. A batch can mix prefills, prefill chunks
(cache_len > 0, several tokens) and decodes (one token); `is_decode` says every request feeds
exactly one token, which is what decode kernels and CUDA graphs want. GQA: query head h reads kv
head h // (num_qo_heads // num_kv_heads). The softmax scale is
`AttentionConfig.scale` (the model's: `CausalLM.attention_scale`).

Per-layer features (`AttentionConfig.layers[layer_id]`, a `LayerAttention`): a sliding window (a
query at position p sees keys p - window + 1 .. p), a soft cap on the logits
(cap * tanh(logit / cap)), attention sinks (one learned logit a query head that joins every
softmax's denominator and adds nothing to the output; the layer hands the [num_qo_heads] fp32
tensor to `forward(..., sinks=)`) and multi-head latent attention (MLA: k [T, 1, head_dim] is
the cached latent and rotary key, v its first `value_dim` values, the output
[T, num_qo_heads, value_dim]; the pool stores K only, `KVPool(v_dim=)`). A backend states what
it computes in `unsupported(spec)`; `create_backend` refuses an explicit backend that cannot
serve a model's layers, naming the feature, and "auto" picks one that can.

Window pool: when a window is shorter than the context, the sliding-window layers keep their KV
in a second pool (`KVPool.window_layers`; their `k`/`v` tensors have the window pool's pages).
For those layers a backend stores at `batch.window_out_loc` and reads through
`batch.window_page_table` instead of `out_loc` / `page_table`, and only keys inside the window:
the scheduler drops (and reuses) the window pages of positions no future query can see, so older
entries of a window row are stale. The torch and triton backends serve windows; `store_loc()` is
None while a window pool exists (a caller storing K/V itself would use the wrong table).

CUDA graphs (decode only, optional: `supports_cuda_graph`): the graph runner calls
`init_cuda_graph(max_bs)` once, then for each captured batch size `prepare_for_capture(batch)`
before capturing the model forward, and `prepare_for_replay(batch)` before each replay instead of
`prepare`. In both, `batch` is padded to the graph's batch size: padded rows have seq_len 1,
cache_len 0, their page-table row all `pool.dummy_page` and out_loc inside the dummy page. The
backend copies what it needs into static buffers it owns, so that captured kernels read from
fixed addresses.

Fused KV store: `store_loc()` returns the flat slots [T] that forward's own store would use, the
very tensor its kernels read (during CUDA-graph capture and replay the backend's static buffer,
since a captured kernel keeps the address it saw). A layer that writes this step's K/V itself
(SelfAttention's fused q/k-norm + rotary + store kernel on CUDA) writes there and calls
`forward(q, k, v, layer_id, kv_stored=True)`; k is then still the rotated k. None: the backend
stores K/V itself, always.

Hybrid mode (`attention.HybridBackend`) routes `is_decode` steps to one backend and the rest to
another; both share one KVPool, so whatever one writes the other reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .kv_pool import KVPool


class BackendUnavailable(RuntimeError):
    """The named backend cannot run here (device, missing package); raised at start-up."""


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention computes beyond plain causal softmax attention."""

    window: int | None = None  # sliding window in tokens, the query itself included
    softcap: float | None = None  # logits -> softcap * tanh(logits / softcap)
    sinks: bool = False  # forward() receives per-head sink logits
    # Multi-head latent attention (DeepSeek MLA): one KV head (the cached latent plus the rotary
    # key) shared by every query head, and V is K's first `value_dim` values (no V of its own),
    # so the output is `value_dim` wide, not head_dim.
    value_dim: int | None = None

    @property
    def plain(self) -> bool:
        return (self.window is None and self.softcap is None and not self.sinks
                and self.value_dim is None)

    def features(self) -> list[str]:
        """The non-plain features by name, for messages."""
        out = []
        if self.window is not None:
            out.append(f"sliding window {self.window}")
        if self.softcap is not None:
            out.append(f"logit soft-cap {self.softcap}")
        if self.sinks:
            out.append("attention sinks")
        if self.value_dim is not None:
            out.append(f"multi-head latent attention (values: the keys' first {self.value_dim})")
        return out


PLAIN = LayerAttention()


@dataclass(frozen=True)
class AttentionConfig:
    num_qo_heads: int  # per TP rank
    num_kv_heads: int  # per TP rank
    head_dim: int
    scale: float  # softmax scale (the model's; head_dim ** -0.5 for most)
    page_size: int
    max_slots: int
    max_pages_per_seq: int
    max_model_len: int
    dtype: torch.dtype  # activations (q, k, v, output)
    device: torch.device
    kv_dtype: torch.dtype | None = None  # KV cache elements; None: as dtype (fp8: half the bytes)
    layers: tuple[LayerAttention, ...] = ()  # per layer; () or a missing entry: PLAIN

    def layer(self, layer_id: int) -> LayerAttention:
        return self.layers[layer_id] if layer_id < len(self.layers) else PLAIN

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @property
    def v_head_dim(self) -> int:
        """The width of V and of the attention output: head_dim, except for MLA layers
        (`LayerAttention.value_dim`; a model's layers all share one)."""
        dims = {spec.value_dim for spec in self.layers if spec.value_dim is not None}
        if len(dims) > 1:
            raise ValueError(f"layers with different value widths {sorted(dims)}")
        return dims.pop() if dims else self.head_dim


@dataclass
class ForwardBatch:
    """One step's layout. Device tensors sit on the KV pool's device; `*_host` are CPU mirrors of
    the same values, so backends can plan (FlashInfer `plan`, grid sizes) without a device sync."""

    batch_size: int  # requests B
    num_tokens: int  # query tokens T = sum(extend_lens)
    is_decode: bool  # every request feeds exactly one token
    page_size: int
    # per token [T]
    positions: torch.Tensor  # int64: sequence index of each query token
    out_loc: torch.Tensor  # int64: flat KV slot where this token's k/v go
    # per request [B]
    slots: torch.Tensor  # int64: rows of the pool's page table
    cache_lens: torch.Tensor  # int32: tokens already in the cache before this step
    extend_lens: torch.Tensor  # int32: query tokens this step
    seq_lens: torch.Tensor  # int32: cache_lens + extend_lens
    qo_indptr: torch.Tensor  # int32 [B+1]: cumulative extend_lens
    page_table: torch.Tensor  # int32 [B, P]: the requests' page-table rows, P = ceil(max_seq/ps)
    # host mirrors
    cache_lens_host: list[int]
    extend_lens_host: list[int]
    seq_lens_host: list[int]
    page_table_host: torch.Tensor  # int32 [B, P] on the CPU
    max_seq_len: int
    max_extend_len: int
    # rows of the hidden states whose logits are computed (last token of each sampled request)
    sample_indices: torch.Tensor  # int64 [S]
    # Optional, from the engine's PlanBuilder (None: a backend derives them from the above):
    # host int32 tensors are pinned on CUDA, so uploading them never waits for the stream.
    qo_indptr_host: torch.Tensor | None = None  # int32 [B+1]
    kv_indptr_host: torch.Tensor | None = None  # int32 [B+1]: FlashInfer's paged_kv_indptr
    kv_indices: torch.Tensor | None = None  # int32 [kv_indptr[-1]] on the device
    kv_last_page_len_host: torch.Tensor | None = None  # int32 [B]
    # Decode steps: the rows longest first (int32 [B] on the device), the order in which the
    # Triton decode kernel starts its programs, so that the longest do not start last.
    decode_order: torch.Tensor | None = None
    # Window pool only (KVPool.window_layers): the sliding-window layers' flat KV slots [T]
    # (int64) and page-table rows [B, P] (int32; the window dummy page where no window KV is
    # kept, beyond every query's window). Those layers store and read through these instead.
    window_out_loc: torch.Tensor | None = None
    window_page_table: torch.Tensor | None = None

    def num_pages_host(self) -> list[int]:
        """Pages each request's KV spans after this step (FlashInfer: diff of paged_kv_indptr)."""
        return [-(-n // self.page_size) for n in self.seq_lens_host]

    def last_page_len_host(self) -> list[int]:
        """Tokens in each request's last page (FlashInfer's paged_kv_last_page_len)."""
        return [(n - 1) % self.page_size + 1 for n in self.seq_lens_host]


def csr_page_layout(seq_lens: np.ndarray, rows: np.ndarray, page_size: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's CSR page layout from sequence lengths [B] and page-table rows [B, P]:
    kv_indptr [B+1] (pages per request, cumulated), kv_indices (the used prefix of each row,
    concatenated) and kv_last_page_len [B] (tokens in each last page); int32."""
    num_pages = -(-seq_lens.astype(np.int64) // page_size)
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(num_pages, out=indptr[1:])
    indices = rows[np.arange(rows.shape[1])[None, :] < num_pages[:, None]].astype(np.int32)
    last = ((seq_lens - 1) % page_size + 1).astype(np.int32)
    return indptr, indices, last


class AttentionBackend(ABC):
    name: ClassVar[str] = "base"
    supports_cuda_graph: ClassVar[bool] = False

    def __init__(self, config: AttentionConfig, pool: KVPool) -> None:
        self.config, self.pool = config, pool

    @classmethod
    def check_available(cls, device: torch.device) -> None:
        """Raise BackendUnavailable with a clear reason if this backend cannot run on `device`.
        The default accepts any device (the torch reference backend)."""
        return None

    @classmethod
    def unsupported(cls, spec: LayerAttention) -> str | None:
        """Why this backend cannot compute a layer described by `spec`, or None if it can. The
        default: plain layers only."""
        feats = spec.features()
        return f"no kernel for {', '.join(feats)}" if feats else None

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Once per step, outside any CUDA graph: plan the step's kernels."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_stored: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store k/v at the step's out_loc in layer `layer_id` (unless `kv_stored`: the caller
        wrote them at `store_loc()`), attend, return [T, Hq, D]. `sinks`: the layer's sink
        logits [Hq] when its `LayerAttention.sinks` is set."""

    def store_loc(self) -> torch.Tensor | None:
        """This step's flat KV slots [T] int64 as forward's store reads them (a static buffer
        under CUDA graphs), for callers that store K/V themselves; None if they may not."""
        return None

    # -- CUDA graph hooks (decode only); backends with supports_cuda_graph=True override them ---

    def init_cuda_graph(self, max_bs: int) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} has no CUDA graph support")

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} has no CUDA graph support")

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} has no CUDA graph support")
