"""The paged KV cache and the per-slot page table, owned by the worker.

Layout (FlashInfer "NHD"; the Triton and FlashInfer backends assume exactly this):

    k[layer], v[layer]: [num_pages, page_size, num_kv_heads, head_dim]
    page_table:         [max_slots, max_pages_per_seq] int32

Token `i` of the request in slot `s` lives at page `page_table[s, i // page_size]`, offset
`i % page_size`; its flat location `page * page_size + offset` indexes the views returned by
`k_flat(layer)` / `v_flat(layer)` ([num_pages * page_size, num_kv_heads, head_dim]).
The scheduler owns which pages and slots are in use; this class only holds the tensors.
Elements are the activation dtype, or fp8 (e4m3/e5m2, `--kv-cache-dtype`): stored unscaled,
saturated at the type's range; attention kernels upcast on load.

MLA mode (`v_dim` set: DeepSeek's multi-head latent attention): one KV head whose K row is the
normed latent followed by the rotary key, and V is a view of K's first `v_dim` values; nothing
else is allocated, so a token costs head_dim values a layer instead of 2 * heads * head_dim.

One extra page, `dummy_page` (= num_pages), is allocated past the scheduler's pages: padded rows
of a CUDA-graph batch point there, so their KV writes can never touch a live request's page.

Window pool (`window_layers`, `window_pages` > 0): the sliding-window layers' k[layer], v[layer]
have `window_pages` + 1 pages instead (the last, `window_dummy_page`, the dummy), indexed through
the batch's second page table (`ForwardBatch.window_page_table`, `window_out_loc`), whose rows the
scheduler fills with window-pool pages and drops from as the window moves on; the other layers
keep the main pool. Flat locations of a windowed layer index its window-pool tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import kv_saturation
from ..kernels import fused_ops


@dataclass(frozen=True)
class KVLayout:
    """What a model's KV cache holds per token and layer (`CausalLM.kv_layout`)."""

    num_kv_heads: int  # the model's KV heads, split over TP ranks; MLA: 1, on every rank
    head_dim: int  # K's width
    v_dim: int | None = None  # MLA: V is K's first v_dim values (KVPool's MLA mode)

    def bytes_per_token(self, num_layers: int, dtype: torch.dtype, tp_size: int = 1) -> int:
        """One token's cache over all layers on one TP rank."""
        heads = self.num_kv_heads if self.v_dim is not None else self.num_kv_heads // tp_size
        return KVPool.bytes_per_page(num_layers, 1, heads, self.head_dim, dtype, self.v_dim)


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_slots: int,
        max_pages_per_seq: int,
        v_dim: int | None = None,
        window_layers: frozenset[int] = frozenset(),
        window_pages: int = 0,
    ) -> None:
        if v_dim is not None and not 0 < v_dim <= head_dim:
            raise ValueError(f"an MLA pool's v_dim ({v_dim}) must be in (0, head_dim={head_dim}]")
        if min(num_layers, num_pages, page_size, num_kv_heads, head_dim, max_slots,
               max_pages_per_seq) <= 0:
            raise ValueError("every KVPool dimension must be positive")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_slots, self.max_pages_per_seq = max_slots, max_pages_per_seq
        self.dummy_page = num_pages
        if bool(window_layers) != (window_pages > 0):
            raise ValueError("a window pool needs both windowed layers and window pages")
        self.window_layers, self.window_pages = window_layers, window_pages
        self.window_dummy_page = window_pages
        shape = (num_pages + 1, page_size, num_kv_heads, head_dim)
        wshape = (window_pages + 1, page_size, num_kv_heads, head_dim)

        # One allocation per layer and kind (not one big tensor) so that each is contiguous and
        # can be handed to kernels as is.
        def alloc(layer: int) -> torch.Tensor:
            return torch.zeros(wshape if layer in window_layers else shape, dtype=dtype,
                               device=self.device)

        self.k = [alloc(i) for i in range(num_layers)]
        self.v_dim = v_dim  # None: V stored apart, head_dim wide
        if v_dim is None:
            self.v = [alloc(i) for i in range(num_layers)]
        else:  # MLA: V is K's leading values, a view (no storage of its own)
            self.v = [k[..., :v_dim] for k in self.k]
        self.page_table = torch.zeros(max_slots, max_pages_per_seq, dtype=torch.int32,
                                      device=self.device)

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, v_dim: int | None = None) -> int:
        """What a page stores over all layers: K and V, or (MLA, `v_dim` set) K only."""
        elem = torch.empty((), dtype=dtype).element_size()
        kinds = 1 if v_dim is not None else 2
        return kinds * num_layers * page_size * num_kv_heads * head_dim * elem

    @property
    def mla(self) -> bool:
        return self.v_dim is not None

    def windowed(self, layer: int) -> bool:
        """The layer keeps its KV in the window pool (its own page table)."""
        return layer in self.window_layers

    def k_flat(self, layer: int) -> torch.Tensor:
        return self.k[layer].view(-1, self.num_kv_heads, self.head_dim)

    def v_flat(self, layer: int) -> torch.Tensor:
        """[slots, num_kv_heads, v width]; under MLA a strided view into K."""
        return self.v[layer].flatten(0, 1)

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [T, num_kv_heads, head_dim] at flat locations `loc` [T] (int64).
        On CUDA one Triton kernel writes both (two index_put ops cost ~11 us each at decode
        batch 256); a negative loc then stores nothing, where index_put would wrap around.
        MLA: only k is written (v is a view of its leading values)."""
        if self.mla:
            self.k_flat(layer)[loc] = self._encode(k)
            return
        if fused_ops.usable(k) and k.stride(-1) == 1 and v.stride(-1) == 1:
            from ..kernels.store_kv import store_kv  # imports triton: only on this path

            store_kv(self.k[layer], self.v[layer], k, v, loc)
            return
        self.k_flat(layer)[loc] = self._encode(k)
        self.v_flat(layer)[loc] = self._encode(v)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """x in the cache's element type; an fp8 cache saturates at its finite range (a plain
        cast can give inf or NaN), like the Triton store kernels."""
        limit = kv_saturation(self.dtype)
        if limit:
            return x.float().clamp(-limit, limit).to(self.dtype)
        return x.to(self.dtype)

    def memory_bytes(self) -> int:
        stored = self.k if self.mla else self.k + self.v  # MLA: V is a view of K
        return sum(t.numel() * t.element_size() for t in stored)
