"""Attention with the worker's own Triton kernels (kernels/): split-K paged decode for
decode-only steps, the paged extend kernel for everything else, and a Triton KV store.

Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (tests). Decode steps can run inside a
CUDA graph: the kernels read the page table, sequence lengths and output slots from static
buffers that `prepare_for_replay` refills, and the split count is fixed per captured batch size
(splits past a request's length exit at once), so one graph serves every sequence length.
Eager decode uses the same split count as the graph of its batch size, so the two agree exactly.
Sliding windows and attention sinks are computed by both kernels; logit soft-caps are not.
Multi-head latent attention (DeepSeek) goes through kernels/mla_attention.py, which reads each
token's one cached latent row for every head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import env
from .base import AttentionBackend, BackendUnavailable, ForwardBatch, LayerAttention


@dataclass
class _StepMeta:
    is_decode: bool
    out_loc: torch.Tensor  # [T] int64
    page_table: torch.Tensor  # [B, P] int32
    rows: torch.Tensor  # [B] int32: the kernels' page-table rows (0..B-1 here)
    seq_lens: torch.Tensor  # [B] int32
    qo_indptr: torch.Tensor  # [B + 1] int32
    cache_lens: torch.Tensor  # [B] int32
    max_extend_len: int
    num_splits: int
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None
    order: torch.Tensor | None = None  # [B] int32: decode rows longest first (paged_decode)
    # the window pool's slots [T] and page-table rows [B, P] (KVPool.window_layers)
    window_out_loc: torch.Tensor | None = None
    window_page_table: torch.Tensor | None = None


@dataclass
class _GraphBuffers:
    page_table: torch.Tensor  # [max_bs, max_pages_per_seq] int32
    seq_lens: torch.Tensor  # [max_bs] int32
    out_loc: torch.Tensor  # [max_bs] int64
    rows: torch.Tensor  # [max_bs] int32
    qo_indptr: torch.Tensor  # [max_bs + 1] int32 (0..max_bs: one token per row)
    cache_lens: torch.Tensor  # [max_bs] int32
    order: torch.Tensor  # [max_bs] int32: the decode rows longest first
    partial: torch.Tensor  # flat fp32 split-K workspace, shared by every graph (never concurrent)
    window_page_table: torch.Tensor | None = None  # the window pool's, as page_table
    window_out_loc: torch.Tensor | None = None


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True

    @classmethod
    def check_available(cls, device: torch.device) -> None:
        interpreted = env.SETTINGS.triton_interpret
        if device.type != "cuda" and not interpreted:
            raise BackendUnavailable("the triton attention backend needs a CUDA device "
                                     "(or TRITON_INTERPRET=1 for CPU tests)")
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailable(f"the triton attention backend needs triton ({exc})") from exc

    @classmethod
    def unsupported(cls, spec: LayerAttention) -> str | None:
        if spec.softcap is not None:
            return f"no kernel for logit soft-cap {spec.softcap}"
        if spec.value_dim is not None and (spec.window is not None or spec.sinks):
            return "no kernel for multi-head latent attention with windows or sinks"
        return None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from ..kernels import mla_attention, paged_decode, paged_extend, store_kv

        self._decode, self._extend, self._store = paged_decode, paged_extend, store_kv
        self._mla = mla_attention
        self._meta: _StepMeta | None = None
        self._rows: torch.Tensor | None = None
        self._graph: _GraphBuffers | None = None

    def _arange_rows(self, n: int) -> torch.Tensor:
        if self._rows is None or self._rows.numel() < n:
            self._rows = torch.arange(max(n, 64), dtype=torch.int32, device=self.config.device)
        return self._rows[:n]

    def prepare(self, batch: ForwardBatch) -> None:
        # Decode uses the CUDA-graph split policy even when it runs eagerly: the split count
        # decides where the KV is cut, so eager and graph decode give bit-identical results.
        splits = self._graph_splits(batch.batch_size) if batch.is_decode else 1
        self._meta = _StepMeta(
            is_decode=batch.is_decode, out_loc=batch.out_loc, page_table=batch.page_table,
            rows=self._arange_rows(batch.batch_size), seq_lens=batch.seq_lens,
            qo_indptr=batch.qo_indptr, cache_lens=batch.cache_lens,
            max_extend_len=batch.max_extend_len, num_splits=splits,
            order=_longest_first(batch) if batch.is_decode else None,
            window_out_loc=batch.window_out_loc, window_page_table=batch.window_page_table)

    def store_loc(self) -> torch.Tensor | None:
        if self.pool.window_layers:  # two tables: a caller storing K/V itself would pick wrong
            return None
        return self._meta.out_loc if self._meta is not None else None  # graph: g.out_loc slice

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_stored: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
        m = self._meta
        if m is None:
            raise RuntimeError("TritonBackend.forward before prepare")
        spec = self.config.layer(layer_id)
        if spec.value_dim is not None:
            return self._latent(q, k, v, layer_id, kv_stored, spec.value_dim, m)
        k_cache, v_cache = self.pool.k[layer_id], self.pool.v[layer_id]
        out_loc, table = m.out_loc, m.page_table
        if self.pool.windowed(layer_id):  # the window pool: its own slots and page table
            if m.window_out_loc is None or m.window_page_table is None or spec.window is None:
                raise RuntimeError(f"layer {layer_id} is in the window pool without a window "
                                   "or the batch's window locations")
            out_loc, table = m.window_out_loc, m.window_page_table
        if not kv_stored:
            self._store.store_kv(k_cache, v_cache, k, v, out_loc)
        window = spec.window
        if m.is_decode:
            return self._decode.paged_decode(
                q, k_cache, v_cache, table, m.rows, m.seq_lens, self.config.scale,
                m.num_splits, workspace=m.workspace, order=m.order, window=window, sinks=sinks)
        return self._extend.paged_extend(
            q, k_cache, v_cache, table, m.rows, m.qo_indptr, m.cache_lens,
            m.max_extend_len, self.config.scale, window=window, sinks=sinks)

    def _latent(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_stored: bool, value_dim: int, m: _StepMeta) -> torch.Tensor:
        """MLA: q [T, H, latent + rope] against the one cached row a token -> [T, H, latent]."""
        if not kv_stored:
            self.pool.store(layer_id, m.out_loc, k, v)
        cache = self.pool.k[layer_id]
        if m.is_decode:
            return self._mla.mla_decode(q, cache, value_dim, m.page_table, m.rows, m.seq_lens,
                                        self.config.scale, m.num_splits, workspace=m.workspace)
        return self._mla.mla_extend(q, cache, value_dim, m.page_table, m.rows, m.qo_indptr,
                                    m.cache_lens, m.max_extend_len, self.config.scale)

    # -- CUDA graphs -----------------------------------------------------------------------------

    def _graph_splits(self, bs: int) -> int:
        """Splits for a decode batch of `bs` rows: from the batch size rounded up to a power of
        two (a padded graph batch rounds to the same one: every power of two up to the largest
        capture size is captured) and max_model_len, never from this step's lengths (splits past
        a request's KV exit at once)."""
        c = self.config
        return self._decode.choose_num_splits(1 << max(0, bs - 1).bit_length(), c.num_kv_heads,
                                              c.max_model_len)

    def init_cuda_graph(self, max_bs: int) -> None:
        c, dev = self.config, self.config.device
        partial_rows = max(bs * self._graph_splits(bs) for bs in range(1, max_bs + 1))
        self._graph = _GraphBuffers(
            page_table=torch.full((max_bs, c.max_pages_per_seq), self.pool.dummy_page,
                                  dtype=torch.int32, device=dev),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=dev),
            out_loc=torch.full((max_bs,), self.pool.dummy_page * c.page_size, dtype=torch.int64,
                               device=dev),
            rows=torch.arange(max_bs, dtype=torch.int32, device=dev),
            qo_indptr=torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            cache_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            order=torch.arange(max_bs, dtype=torch.int32, device=dev),
            partial=torch.empty(partial_rows * c.num_qo_heads * (c.head_dim + 1),
                                dtype=torch.float32, device=dev),
        )
        if self.pool.window_layers:
            self._graph.window_page_table = torch.full(
                (max_bs, c.max_pages_per_seq), self.pool.window_dummy_page, dtype=torch.int32,
                device=dev)
            self._graph.window_out_loc = torch.full(
                (max_bs,), self.pool.window_dummy_page * c.page_size, dtype=torch.int64,
                device=dev)

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        self.prepare_for_replay(batch)

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        g, c = self._graph, self.config
        if g is None:
            raise RuntimeError("TritonBackend: init_cuda_graph must come before capture/replay")
        bs = batch.batch_size
        if not batch.is_decode or bs > g.seq_lens.numel():
            raise ValueError(f"CUDA graphs take decode batches of at most {g.seq_lens.numel()}")
        pages = batch.page_table.shape[1]
        g.page_table[:bs, :pages].copy_(batch.page_table, non_blocking=True)
        g.seq_lens[:bs].copy_(batch.seq_lens, non_blocking=True)
        g.out_loc[:bs].copy_(batch.out_loc, non_blocking=True)
        g.order[:bs].copy_(_longest_first(batch), non_blocking=True)
        w_table = w_loc = None
        if g.window_page_table is not None and g.window_out_loc is not None:
            if batch.window_page_table is None or batch.window_out_loc is None:
                raise ValueError("a window pool's decode batch without window locations")
            g.window_page_table[:bs, :pages].copy_(batch.window_page_table, non_blocking=True)
            g.window_out_loc[:bs].copy_(batch.window_out_loc, non_blocking=True)
            w_table, w_loc = g.window_page_table[:bs], g.window_out_loc[:bs]
        splits = self._graph_splits(bs)
        h, d = c.num_qo_heads, c.v_head_dim  # the output's width (MLA: the latent's)
        n_o = bs * h * splits * d
        part_o = g.partial[:n_o].view(bs, h, splits, d)
        part_lse = g.partial[n_o : n_o + bs * h * splits].view(bs, h, splits)
        self._meta = _StepMeta(
            is_decode=True, out_loc=g.out_loc[:bs], page_table=g.page_table[:bs],
            rows=g.rows[:bs], seq_lens=g.seq_lens[:bs], qo_indptr=g.qo_indptr[: bs + 1],
            cache_lens=g.cache_lens[:bs], max_extend_len=1, num_splits=splits,
            workspace=(part_o, part_lse), order=g.order[:bs], window_out_loc=w_loc,
            window_page_table=w_table)


def _longest_first(batch: ForwardBatch) -> torch.Tensor:
    """The decode rows longest first: the engine's (PlanBuilder uploads it with the step),
    else sorted here on the device (batches built elsewhere: tests, the graph runner's
    padding)."""
    order = batch.decode_order
    if order is not None and order.numel() == batch.batch_size:
        return order
    return torch.argsort(batch.seq_lens, descending=True, stable=True).to(torch.int32)
