"""The reference attention backend in plain torch: runs anywhere, handles any batch.

Per request it gathers the request's KV from its pages, and attends with an explicit causal mask
offset by the cached length, so prefills, chunked prefills (cache_len > 0) and decodes all take
the same path. It loops over requests: it is the oracle for the fast backends and the CPU path,
not a GPU serving kernel. It computes every per-layer feature (windows, soft-caps, sinks, MLA): plain
layers take SDPA, the others an explicit softmax.

With a window pool (KVPool.window_layers) a sliding-window layer stores at the batch's
`window_out_loc` and reads through `window_page_table`, gathering only the keys its queries can
see (from the first query's position - window + 1): older entries of that table may name pages
the scheduler has dropped and handed to another request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .base import AttentionBackend, ForwardBatch, LayerAttention


@dataclass
class _ReqView:
    q_start: int
    q_end: int
    kv_loc: torch.Tensor  # int64 [seq_len]: flat KV slots of tokens 0..seq_len-1
    mask: torch.Tensor | None  # bool [ext, seq_len], None when a single query sees everything
    distance: torch.Tensor  # int64 [ext, seq_len]: query position - key position
    # Window pool: per window size, (first key position, its flat window-pool slots).
    window_loc: dict[int, tuple[int, torch.Tensor]] | None = None


class TorchBackend(AttentionBackend):
    name = "torch"

    @classmethod
    def unsupported(cls, spec: LayerAttention) -> str | None:
        return None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batch: ForwardBatch | None = None
        self._reqs: list[_ReqView] = []

    def prepare(self, batch: ForwardBatch) -> None:
        self._batch = batch
        ps = batch.page_size
        dev = batch.page_table.device
        self._reqs = []
        windows = sorted({w for i in self.pool.window_layers
                          if (w := self.config.layer(i).window) is not None})
        start = 0
        for i in range(batch.batch_size):
            ext, seq = batch.extend_lens_host[i], batch.seq_lens_host[i]
            pos = torch.arange(seq, device=dev)
            pages = batch.page_table[i].to(torch.int64)[pos // ps]
            loc = pages * ps + pos % ps
            q_pos = torch.arange(seq - ext, seq, device=dev)
            distance = q_pos[:, None] - pos[None, :]
            mask = distance >= 0 if ext > 1 else None
            view = _ReqView(start, start + ext, loc, mask, distance)
            if windows:
                table = batch.window_page_table
                if table is None:
                    raise RuntimeError("a window pool without the batch's window page table")
                view.window_loc = {}
                for w in windows:  # the keys the first query (at seq - ext) can see, on
                    lo = max(0, seq - ext - w + 1)
                    wpos = pos[lo:]
                    view.window_loc[w] = (lo, table[i].to(torch.int64)[wpos // ps] * ps
                                          + wpos % ps)
            self._reqs.append(view)
            start += ext

    def store_loc(self) -> torch.Tensor | None:
        if self._batch is None or self.pool.window_layers:
            return None  # windowed layers store elsewhere: the backend stores every layer
        return self._batch.out_loc

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_stored: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
        batch = self._batch
        if batch is None:
            raise RuntimeError("TorchBackend.forward before prepare")
        spec = self.config.layer(layer_id)
        windowed = self.pool.windowed(layer_id)
        if windowed and (batch.window_out_loc is None or spec.window is None):
            raise RuntimeError(f"layer {layer_id} is in the window pool without a window or "
                               "the batch's window locations")
        if not kv_stored:
            loc = batch.window_out_loc if windowed else batch.out_loc
            self.pool.store(layer_id, loc, k, v)  # type: ignore[arg-type]  # checked above
        k_all, v_all = self.pool.k_flat(layer_id), self.pool.v_flat(layer_id)
        groups = q.shape[1] // k.shape[1]
        # MLA's one latent head: broadcast over the query heads (written out below) rather than
        # copied once per head.
        if spec.value_dim is not None:
            groups = 1
        out = q.new_empty(*q.shape[:2], v_all.shape[-1])
        for r in self._reqs:
            kv_loc, lo = r.kv_loc, 0
            if windowed:
                assert r.window_loc is not None and spec.window is not None
                lo, kv_loc = r.window_loc[spec.window]
            # [heads, tokens, dim] for sdpa; GQA by repeating each kv head over its query group.
            qr = q[r.q_start:r.q_end].transpose(0, 1)
            kr = k_all[kv_loc].to(q.dtype).transpose(0, 1).repeat_interleave(groups, dim=0)
            vr = v_all[kv_loc].to(q.dtype).transpose(0, 1).repeat_interleave(groups, dim=0)
            if spec.plain:
                o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=r.mask,
                                                   scale=self.config.scale)
            else:
                o = self._explicit(qr, kr, vr, r.distance[:, lo:], spec, sinks)
            out[r.q_start:r.q_end] = o.transpose(0, 1)
        return out

    def _explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  distance: torch.Tensor, spec: LayerAttention,
                  sinks: torch.Tensor | None) -> torch.Tensor:
        """Softmax attention written out, in fp32: q [H, ext, D], k [H, n, D], v [H, n, Dv] with
        `distance` [ext, n] (query position - key position)."""
        logits = torch.matmul(q.float(), k.float().transpose(1, 2)) * self.config.scale
        if spec.softcap is not None:
            logits = spec.softcap * torch.tanh(logits / spec.softcap)
        visible = distance >= 0
        if spec.window is not None:
            visible = visible & (distance < spec.window)
        logits = logits.masked_fill(~visible, float("-inf"))
        if spec.sinks:
            if sinks is None:
                raise ValueError(f"layer with attention sinks called without them ({spec})")
            sink = sinks.float().view(-1, 1, 1).expand(-1, logits.shape[1], 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1)
        return torch.matmul(probs, v.float()).to(q.dtype)
