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

One extra page, `dummy_page` (= num_pages), is allocated past the scheduler's pages: padded rows
of a CUDA-graph batch point there, so their KV writes can never touch a live request's page.

Window pool (`window_layers`, `window_pages` > 0): the sliding-window layers' k[layer], v[layer]
have `window_pages` + 1 pages instead (the last, `window_dummy_page`, the dummy), indexed through
the batch's second page table (`ForwardBatch.window_page_table`, `window_out_loc`), whose rows the
scheduler fills with window-pool pages and drops from as the window moves on; the other layers
keep the main pool. Flat locations of a windowed layer index its window-pool tensors.
"""

from __future__ import annotations

import torch

from ..config import kv_saturation
from ..kernels import fused_ops


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
        window_layers: frozenset[int] = frozenset(),
        window_pages: int = 0,
    ) -> None:
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
        self.v = [alloc(i) for i in range(num_layers)]
        self.page_table = torch.zeros(max_slots, max_pages_per_seq, dtype=torch.int32,
                                      device=self.device)

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem

    def windowed(self, layer: int) -> bool:
        """The layer keeps its KV in the window pool (its own page table)."""
        return layer in self.window_layers

    def k_flat(self, layer: int) -> torch.Tensor:
        return self.k[layer].view(-1, self.num_kv_heads, self.head_dim)

    def v_flat(self, layer: int) -> torch.Tensor:
        return self.v[layer].view(-1, self.num_kv_heads, self.head_dim)

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [T, num_kv_heads, head_dim] at flat locations `loc` [T] (int64).
        On CUDA one Triton kernel writes both (two index_put ops cost ~11 us each at decode
        batch 256); a negative loc then stores nothing, where index_put would wrap around."""
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
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
