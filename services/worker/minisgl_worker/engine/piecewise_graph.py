"""CUDA graphs for the other steps (prefills, prefill chunks, mixed steps) up to a token count,
captured in pieces that end at each attention call.

Why: such a step runs eagerly, and its host side (a few hundred kernel launches through Python:
the layers' Triton kernels, cuBLAS calls, module calls) took 17-32 ms a step on Qwen3-0.6B and
about 20 ms for a 1,024-token prompt of Qwen3-8B at TP=2, more than the GPU work of a short
prompt: the GPU waited on the host, which set the time to first token. The attention kernels
cannot be captured for every layout of requests (FlashInfer plans each step on the host), but
everything between two attention calls is the same for a given token count. So, per padded token
count S, the forward is captured as L + 1 graphs (L layers): piece i ends where layer i's
attention starts. A step of T <= S tokens copies its inputs into static buffers, plans the
attention as usual, then replays piece 0, runs layer 0's attention eagerly on the first T rows,
replays piece 1, and so on: L + 1 replays and L attention launches instead of every launch.

    pw = PiecewiseGraphs(model, backend, pool, max_tokens=2048)   # captures at construction
    if pw.can_run(batch):
        hidden = pw.run(input_ids, batch)                        # [T, hidden], a static view

Handing over at the cut: inside the graph the piece copies the layer's q (and k, v when the
layer did not store them itself) into static buffers; the eager attention reads the first T rows
and its output is copied into a static buffer that the next piece reads. The padding rows
(T..S) compute garbage that nothing reads; their K/V go to the pool's dummy page (the static
store location holds it there), never to a live page. The copies cost ~3 q-sized passes a layer,
which is why long steps (past `max_tokens`, GPU-bound anyway) stay eager.

`eager=True` runs the same plumbing without graphs (the attention runs at each cut as a replay
would): testable on a CPU.
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

# Where a piece ends: the layer whose attention runs there, whether its K/V were stored already,
# and its sink logits (a parameter: the same tensor at capture and replay).
Cut = tuple[int, bool, "torch.Tensor | None"]

ModelForward = Callable[[torch.Tensor, torch.Tensor, AttentionBackend], torch.Tensor]


def piecewise_sizes(max_tokens: int) -> list[int]:
    """16, 32, 64, 96, 128, then every 64 up to 512 and every 128 beyond, ending exactly at
    max_tokens. Padding rows cost GEMM work only where a step is compute-bound, i.e. long: past
    512 tokens a step pads at most 25 % (12.5 % past 1,024); shorter steps are bound by the
    host or by the weight reads, which padding does not add to."""
    sizes, s = [], 16
    while s < max_tokens:
        sizes.append(s)
        s = s * 2 if s < 64 else s + (32 if s < 128 else 64 if s < 512 else 128)
    return sizes + [max_tokens]


class _Cut(AttentionBackend):
    """What the model sees as its attention backend while a size is warmed up, captured or run
    eagerly: each `forward` stashes q (k, v) in the static buffers and, per mode, returns at
    once (warm-up), ends the current graph and begins the next (capture), or runs the real
    attention on the step's rows (eager)."""

    name = "piecewise-cut"

    def __init__(self, owner: PiecewiseGraphs, size: int, mode: str, rows: int = 0) -> None:
        super().__init__(owner.backend.config, owner.pool)
        self.owner, self.size, self.mode, self.rows = owner, size, mode, rows
        self.cuts: list[Cut] = []  # (layer_id, kv_stored, sinks) at each cut, in order
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.graph: torch.cuda.CUDAGraph | None = None

    def prepare(self, batch: ForwardBatch) -> None:  # the owner prepares the real backend
        return None

    def store_loc(self) -> torch.Tensor | None:
        if self.owner.pool.window_layers:  # two page tables: the backend stores K/V itself
            return None
        return self.owner.loc[: self.size]

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.owner.mempool)

    def end(self) -> None:
        assert self.graph is not None
        self.graph.capture_end()
        self.pieces.append(self.graph)
        self.graph = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_stored: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
        o, s = self.owner, self.size
        o.q[:s].copy_(q)
        if not kv_stored:
            o.k[:s].copy_(k)
            o.v[:s].copy_(v)
        self.cuts.append((layer_id, kv_stored, sinks))
        if self.mode == "capture":
            self.end()
            self.begin()
        elif self.mode == "eager":
            o.attend(layer_id, kv_stored, self.rows, sinks)
        return o.out[:s]


class PiecewiseGraphs:
    def __init__(self, model: ModelForward, backend: AttentionBackend, pool: KVPool,
                 max_tokens: int, eager: bool = False) -> None:
        self.model, self.backend, self.pool, self.eager = model, backend, pool, eager
        self.device = pool.device
        self.sizes = piecewise_sizes(max(1, max_tokens))
        self.max_tokens = self.sizes[-1]
        self.mempool = None if eager else torch.cuda.graph_pool_handle()
        self._pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._cuts: dict[int, list[Cut]] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served (for metrics and tests)
        c, n, dev = backend.config, self.max_tokens, self.device
        self.dummy_slot = pool.dummy_page * pool.page_size
        with torch.inference_mode():
            self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
            self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
            self.loc = torch.full((n,), self.dummy_slot, dtype=torch.int64, device=dev)
            # V and the output are v_head_dim wide: head_dim, or MLA's latent width.
            dv = c.v_head_dim
            self.q = torch.zeros(n, c.num_qo_heads, c.head_dim, dtype=c.dtype, device=dev)
            self.k = torch.zeros(n, c.num_kv_heads, c.head_dim, dtype=c.dtype, device=dev)
            self.v = torch.zeros(n, c.num_kv_heads, dv, dtype=c.dtype, device=dev)
            self.out = torch.zeros(n, c.num_qo_heads, dv, dtype=c.dtype, device=dev)
            if not eager:
                t0 = time.perf_counter()
                try:
                    self._capture_all()
                except Exception as exc:  # say which flag turns them off
                    raise RuntimeError(
                        f"capturing the prefill steps' CUDA graph pieces failed ({exc}); start "
                        "the worker with --piecewise-max-tokens 0 to run those steps eagerly"
                    ) from exc
                log.info("CUDA graphs: steps of up to %d tokens in %d sizes, %d pieces each, "
                         "captured in %.1fs", self.max_tokens, len(self.sizes),
                         len(self._pieces[self.max_tokens]), time.perf_counter() - t0)

    def _capture_all(self) -> None:
        stream = torch.cuda.Stream(self.device)
        # Largest first: the smaller sizes' pieces reuse the memory the largest left in the pool.
        sizes = list(reversed(self.sizes))
        for size in progress(sizes, total=len(sizes), desc="capturing step pieces", unit="size"):
            ids, pos = self.input_ids[:size], self.positions[:size]
            self.model(ids, pos, _Cut(self, size, "warm-up"))  # compiles, lazy workspaces
            torch.cuda.synchronize(self.device)
            cut = _Cut(self, size, "capture")
            with torch.cuda.stream(stream):
                cut.begin()
                out = self.model(ids, pos, cut)
                cut.end()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self._pieces[size], self._cuts[size], self._outputs[size] = cut.pieces, cut.cuts, out
        torch.cuda.synchronize(self.device)

    def can_run(self, batch: ForwardBatch) -> bool:
        return not batch.is_decode and 0 < batch.num_tokens <= self.max_tokens

    def size_for(self, num_tokens: int) -> int:
        for s in self.sizes:
            if s >= num_tokens:
                return s
        raise ValueError(f"a step of {num_tokens} tokens exceeds the largest size "
                         f"({self.max_tokens})")

    def attend(self, layer_id: int, kv_stored: bool, rows: int,
               sinks: torch.Tensor | None = None) -> None:
        """The real attention of one layer on the step's rows, between two pieces (`sinks`: the
        layer's parameter, the same tensor at capture and replay)."""
        out = self.backend.forward(self.q[:rows], self.k[:rows], self.v[:rows], layer_id,
                                   kv_stored=kv_stored, sinks=sinks)
        self.out[:rows].copy_(out)

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, H] of a non-decode step of T <= max_tokens tokens: a view of a
        static buffer, valid until the next step (consume it in stream order)."""
        if not self.can_run(batch):
            raise ValueError("PiecewiseGraphs.run takes non-decode steps within max_tokens")
        t = batch.num_tokens
        size = self.size_for(t)
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(batch.positions, non_blocking=True)
        self.loc[t:size].fill_(self.dummy_slot)  # earlier, longer steps left live slots there
        self.loc[:t].copy_(batch.out_loc, non_blocking=True)
        self.backend.prepare(batch)
        self.replays += 1
        if self.eager:
            cut = _Cut(self, size, "eager", rows=t)
            return self.model(self.input_ids[:size], self.positions[:size], cut)[:t]
        pieces = self._pieces[size]
        for piece, (layer_id, kv_stored, sinks) in zip(pieces, self._cuts[size], strict=False):
            piece.replay()
            self.attend(layer_id, kv_stored, t, sinks)
        pieces[-1].replay()
        return self._outputs[size][:t]

    def release(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for pieces in self._pieces.values():
            for piece in pieces:
                piece.reset()
        self._pieces.clear()
        self._outputs.clear()
