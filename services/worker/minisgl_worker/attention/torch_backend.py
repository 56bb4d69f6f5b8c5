"""The reference attention backend in plain torch: runs anywhere, handles any batch.

Per request it gathers the request's KV from its pages, and attends with an explicit causal mask
offset by the cached length, so prefills, chunked prefills (cache_len > 0) and decodes all take
the same path. It loops over requests: it is the oracle for the fast backends and the CPU path,
not a GPU serving kernel. It computes every per-layer feature (windows, soft-caps, sinks, MLA): plain
layers take SDPA, the others an explicit softmax.
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
        start = 0
        for i in range(batch.batch_size):
            ext, seq = batch.extend_lens_host[i], batch.seq_lens_host[i]
            pos = torch.arange(seq, device=dev)
            pages = batch.page_table[i].to(torch.int64)[pos // ps]
            loc = pages * ps + pos % ps
            q_pos = torch.arange(seq - ext, seq, device=dev)
            distance = q_pos[:, None] - pos[None, :]
            mask = distance >= 0 if ext > 1 else None
            self._reqs.append(_ReqView(start, start + ext, loc, mask, distance))
            start += ext

    def store_loc(self) -> torch.Tensor | None:
        return self._batch.out_loc if self._batch is not None else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                kv_stored: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
        batch = self._batch
        if batch is None:
            raise RuntimeError("TorchBackend.forward before prepare")
        if not kv_stored:
            self.pool.store(layer_id, batch.out_loc, k, v)
        k_all, v_all = self.pool.k_flat(layer_id), self.pool.v_flat(layer_id)
        groups = q.shape[1] // k.shape[1]
        spec = self.config.layer(layer_id)
        # MLA's one latent head: broadcast over the query heads (written out below) rather than
        # copied once per head.
        if spec.value_dim is not None:
            groups = 1
        out = q.new_empty(*q.shape[:2], v_all.shape[-1])
        for r in self._reqs:
            # [heads, tokens, dim] for sdpa; GQA by repeating each kv head over its query group.
            qr = q[r.q_start:r.q_end].transpose(0, 1)
            kr = k_all[r.kv_loc].to(q.dtype).transpose(0, 1).repeat_interleave(groups, dim=0)
            vr = v_all[r.kv_loc].to(q.dtype).transpose(0, 1).repeat_interleave(groups, dim=0)
            if spec.plain:
                o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=r.mask,
                                                   scale=self.config.scale)
            else:
                o = self._explicit(qr, kr, vr, r, spec, sinks)
            out[r.q_start:r.q_end] = o.transpose(0, 1)
        return out

    def _explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: _ReqView,
                  spec: LayerAttention, sinks: torch.Tensor | None) -> torch.Tensor:
        """Softmax attention written out, in fp32: q [H, ext, D], k [H, seq, D], v [H, seq, Dv]."""
        logits = torch.matmul(q.float(), k.float().transpose(1, 2)) * self.config.scale
        if spec.softcap is not None:
            logits = spec.softcap * torch.tanh(logits / spec.softcap)
        visible = r.distance >= 0
        if spec.window is not None:
            visible = visible & (r.distance < spec.window)
        logits = logits.masked_fill(~visible, float("-inf"))
        if spec.sinks:
            if sinks is None:
                raise ValueError(f"layer with attention sinks called without them ({spec})")
            sink = sinks.float().view(-1, 1, 1).expand(-1, logits.shape[1], 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1)
        return torch.matmul(probs, v.float()).to(q.dtype)
