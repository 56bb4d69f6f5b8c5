"""CUDA graphs for decode-only steps: capture the model forward once per padded batch size, then
replay it with new inputs copied into static buffers.

    runner = CudaGraphRunner(model, backend, pool, max_bs)     # captures at construction
    if runner.can_run(batch):
        hidden = runner.run(input_ids, batch)                  # [B, hidden] (a view, see run)

A decode batch of B requests runs in the graph of the smallest captured size >= B; the extra rows
are padding shaped as the attention interface prescribes (seq_len 1, cache_len 0, page-table row
all `pool.dummy_page`, KV written inside the dummy page), so they can never touch a live page.
The engine's PlanBuilder builds decode batches already padded (`padded_size`); `run` pads
others itself. Attention planning (`backend.prepare_for_replay`) happens on the host before each
replay: only the kernels are in the graph, and they read the step's metadata from the backend's
static buffers. With `logits=` the LM head is captured too and `run` returns logits; sampling
stays outside the graph.

`eager=True` replays by running the forward on the static buffers instead of a captured graph:
the same plumbing (padding, static inputs, backend replay hooks) testable without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from minisgl_core.progress import progress

from ..attention.base import AttentionBackend, ForwardBatch
from ..attention.kv_pool import KVPool

log = logging.getLogger(__name__)

ModelForward = Callable[[torch.Tensor, torch.Tensor, AttentionBackend], torch.Tensor]


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256 and every 16 beyond, ending exactly at max_bs: padding
    wastes at most 7 rows (15 past 256) of a decode batch."""
    sizes = [s for s in (1, 2, 4) if s < max_bs]
    s = 8
    while s < max_bs:
        sizes.append(s)
        s += 8 if s < 256 else 16
    return sizes + [max_bs]


def pad_decode_batch(batch: ForwardBatch, bs: int, dummy_page: int,
                     window_dummy_page: int | None = None) -> ForwardBatch:
    """`batch` (decode, B <= bs rows) grown to bs rows of padding; the same batch if B == bs.
    A window pool's fields (present when `window_dummy_page` is given) pad to its dummy page."""
    b, n = batch.batch_size, bs - batch.batch_size
    if n < 0 or not batch.is_decode:
        raise ValueError(f"cannot pad a {'decode' if batch.is_decode else 'mixed'} batch of "
                         f"{b} rows to {bs}")
    if n == 0:
        return batch
    dev, ps = batch.positions.device, batch.page_size
    i32, i64 = torch.int32, torch.int64
    width = batch.page_table.shape[1] if b else 1

    def grow(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((n, *t.shape[1:]), value, dtype=t.dtype, device=dev)])

    table_host = batch.page_table_host if b else torch.zeros(0, width, dtype=i32)
    pad_table_host = torch.full((n, width), dummy_page, dtype=i32)
    w_loc = w_table = None
    if window_dummy_page is not None:
        w_loc = grow(batch.window_out_loc if batch.window_out_loc is not None
                     else torch.zeros(0, dtype=i64, device=dev), window_dummy_page * ps)
        rows = (batch.window_page_table.view(b, width) if batch.window_page_table is not None
                else torch.zeros(0, width, dtype=i32, device=dev))
        w_table = torch.cat([rows, torch.full((n, width), window_dummy_page, dtype=i32,
                                              device=dev)])
    return ForwardBatch(
        batch_size=bs, num_tokens=bs, is_decode=True, page_size=ps,
        positions=grow(batch.positions, 0), out_loc=grow(batch.out_loc, dummy_page * ps),
        slots=grow(batch.slots, 0), cache_lens=grow(batch.cache_lens, 0),
        extend_lens=grow(batch.extend_lens, 1), seq_lens=grow(batch.seq_lens, 1),
        qo_indptr=torch.arange(bs + 1, dtype=i32, device=dev),
        page_table=torch.cat([batch.page_table.view(b, width),
                              torch.full((n, width), dummy_page, dtype=i32, device=dev)]),
        cache_lens_host=batch.cache_lens_host + [0] * n,
        extend_lens_host=batch.extend_lens_host + [1] * n,
        seq_lens_host=batch.seq_lens_host + [1] * n,
        page_table_host=torch.cat([table_host.view(b, width), pad_table_host]),
        max_seq_len=max(batch.max_seq_len, 1), max_extend_len=1,
        sample_indices=batch.sample_indices.to(i64), window_out_loc=w_loc,
        window_page_table=w_table,
    )


def _empty_decode_batch(device: torch.device, page_size: int) -> ForwardBatch:
    z32, z64 = torch.zeros(0, dtype=torch.int32, device=device), torch.zeros(0, dtype=torch.int64,
                                                                            device=device)
    return ForwardBatch(
        batch_size=0, num_tokens=0, is_decode=True, page_size=page_size, positions=z64,
        out_loc=z64, slots=z64, cache_lens=z32, extend_lens=z32, seq_lens=z32,
        qo_indptr=torch.zeros(1, dtype=torch.int32, device=device),
        page_table=torch.zeros(0, 1, dtype=torch.int32, device=device), cache_lens_host=[],
        extend_lens_host=[], seq_lens_host=[], page_table_host=torch.zeros(0, 1, dtype=torch.int32),
        max_seq_len=0, max_extend_len=0, sample_indices=z64)


class CudaGraphRunner:
    def __init__(self, model: ModelForward, backend: AttentionBackend, pool: KVPool,
                 max_bs: int, eager: bool = False,
                 logits: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`logits`, when given, maps the hidden states to logits inside the graph: `run` then
        returns logits [B, vocab] (`returns_logits`), which spares the host a launch of the LM
        head per step and keeps its shapes fixed."""
        if not backend.supports_cuda_graph:
            raise ValueError(f"attention backend {backend.name!r} cannot run in CUDA graphs")
        self.backend, self.pool, self.eager = backend, pool, eager
        # Padded rows of a window pool's batches point at its dummy page too.
        self._window_dummy = pool.window_dummy_page if pool.window_layers else None
        self.returns_logits = logits is not None
        self.model = model
        if logits is not None:
            hidden_of = model

            def model_with_logits(ids: torch.Tensor, pos: torch.Tensor,
                                  attn: AttentionBackend) -> torch.Tensor:
                return logits(hidden_of(ids, pos, attn))

            self.model = model_with_logits
        self.device = pool.device
        self.sizes = capture_sizes(max(1, min(max_bs, pool.max_slots)))
        self.max_bs = self.sizes[-1]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # decode steps served by a graph (for metrics and tests)
        with torch.inference_mode():
            # Static inputs; padding rows keep whatever valid ids/positions they last held.
            self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=self.device)
            self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=self.device)
            backend.init_cuda_graph(self.max_bs)
            t0 = time.perf_counter()
            self._capture_all()
        log.info("CUDA graphs: %d batch sizes up to %d captured in %.1fs%s", len(self.sizes),
                 self.max_bs, time.perf_counter() - t0, " (eager)" if eager else "")

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self.backend)

    def _capture_all(self) -> None:
        empty = _empty_decode_batch(self.device, self.pool.page_size)
        mempool = None if self.eager else torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs then fit in the memory the largest one left in the pool.
        sizes = list(reversed(self.sizes))
        for bs in progress(sizes, total=len(sizes), desc="capturing CUDA graphs", unit="graph"):
            batch = pad_decode_batch(empty, bs, self.pool.dummy_page, self._window_dummy)
            self.backend.prepare_for_capture(batch)
            if self.eager:
                continue
            for _ in range(2):  # warm-up outside the capture: kernel compiles, lazy workspaces
                self._forward(bs)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                self._outputs[bs] = self._forward(bs)
            self._graphs[bs] = graph

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and 0 < batch.batch_size <= self.max_bs

    def padded_size(self, batch_size: int) -> int | None:
        """The captured size a decode batch of `batch_size` rows replays in; None: eager."""
        if not 0 < batch_size <= self.max_bs:
            return None
        return self.graph_size(batch_size)

    def graph_size(self, batch_size: int) -> int:
        for s in self.sizes:
            if s >= batch_size:
                return s
        raise ValueError(f"batch of {batch_size} exceeds the largest graph ({self.max_bs})")

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [B, H] (logits [B, V] with `returns_logits`) of a decode batch. The
        result is a view of the graph's static
        output: consume it (e.g. gather the logits rows) before the next `run`; work queued on
        the same stream is ordered, so the engine's usual flow is safe."""
        if not self.can_run(batch):
            raise ValueError("CudaGraphRunner.run takes decode batches within the captured sizes")
        b = batch.batch_size
        bs = self.graph_size(b)
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(batch.positions, non_blocking=True)
        self.backend.prepare_for_replay(pad_decode_batch(batch, bs, self.pool.dummy_page,
                                                         self._window_dummy))
        self.replays += 1
        if self.eager:
            return self._forward(bs)[:b]
        self._graphs[bs].replay()
        return self._outputs[bs][:b]

    def release(self) -> None:
        """Destroy the captured graphs now. NCCL keeps a reference on its communicator for every
        graph that captured one of its collectives and will not tear the communicator down while
        any is alive (TP shutdown sat in ncclCommAbort until the process died)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._outputs.clear()
