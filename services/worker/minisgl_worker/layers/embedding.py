"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous block of vocab rows.

The vocabulary is padded to a multiple of tp_size; padded rows are zero and their logits are cut
off after the all-gather (or skipped by the sharded draw, which never gathers them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import all_gather_last, all_reduce, tp
from ..kernels import fused_ops
from .weights import WeightSource, check_shape, new_param, read, set_loader, src_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        size = tp().size
        self.vocab_size, self.dim = vocab_size, dim
        self.local = -(-vocab_size // size)
        self.start = tp().rank * self.local
        self.weight = set_loader(new_param(self.local, dim), self._load)

    def _load(self, param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
        check_shape("an embedding / lm_head", src_shape(src), (self.vocab_size, self.dim))
        n = max(0, min(self.local, self.vocab_size - self.start))
        param.data.zero_()
        if n:
            param.data[:n].copy_(read(src, 0, self.start, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp().size == 1:
            return F.embedding(ids, self.weight)
        if fused_ops.usable(self.weight) and ids.dim() == 1 and ids.is_contiguous():
            return all_reduce(fused_ops.embedding_shard(ids, self.weight, self.start))
        local = ids - self.start
        outside = (local < 0) | (local >= self.local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside[:, None], 0))


class ParallelLMHead(VocabParallelEmbedding):
    """`softcap` (Gemma's final_logit_softcapping): logits -> cap * tanh(logits / cap), in the
    activation dtype as transformers computes it. Applied to each rank's shard in `local_logits`,
    the one place every logits path (forward, the sharded draw, the graphs) goes through; it is
    elementwise, so the gathered logits are the capped full ones (padding columns stay 0)."""

    softcap: float | None = None

    def forward(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """[N, H] -> logits [N, vocab] (the full vocabulary on every rank): fp32, or with
        fp32=False in the activation dtype, for the sampler, which upcasts only where it must
        (at a large decode batch the fp32 copy alone is a full extra pass over the logits). The
        activation-dtype logits may be a strided view that cuts off the padded vocabulary."""
        logits = self.gather(self.local_logits(hidden))
        return logits.float() if fp32 else logits

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> this rank's shard of the logits, [N, local] in the activation dtype: tokens
        start .. start + local - 1, the last rank's columns past the vocabulary being padding
        (zero rows). At TP > 1 the sampler's one-pass draw reads it without a gather
        (sampling/sharded.py)."""
        logits = fused_ops.linear(hidden, self.weight)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's `local_logits` -> the full [N, vocab] (a strided view without the
        padding)."""
        return all_gather_last(local)[:, : self.vocab_size]
