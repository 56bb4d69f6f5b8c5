"""The fast-path draw at TP > 1 from each rank's vocabulary shard, without gathering the logits.

The sampler's one-pass draw (greedy argmax, or the Gumbel-max race of `ops`) scores
every token from its own logit and its global id only. So each rank scores its shard of the LM
head's logits and keeps, per row, its best (score, global id); the ranks exchange those [B]
pairs and every rank takes the best: the highest score, ties to the lowest id (the lower rank's
shard), which is what torch.argmax and the kernel pick over the whole vocabulary. The token is
the same, bit for bit, as the draw over gathered logits, and every rank ends with the same
tokens. A rank exchanges B pairs instead of receiving (N-1)/N of the [B, V] logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import distributed as dist
from . import ops

# (scores float32 [B], ids int64 [B]) of this rank -> the chosen ids [B], the same on every rank.
Combine = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class VocabShard:
    """The tokens whose logits a rank holds: ids start .. start + size - 1. The LM head pads the
    vocabulary to a multiple of the TP size, so the last rank may hold fewer real tokens than
    columns (or none); its padding columns are never drawn."""

    start: int
    size: int

    @staticmethod
    def of_rank(vocab_size: int, rank: int, tp_size: int) -> VocabShard:
        """The shard of `VocabParallelEmbedding` on `rank`: blocks of ceil(V / N) rows."""
        local = -(-vocab_size // tp_size)
        start = rank * local
        return VocabShard(start, max(0, min(local, vocab_size - start)))


def shard_best(logits: torch.Tensor, shard: VocabShard, seeds: torch.Tensor | None,
               positions: torch.Tensor, temps: torch.Tensor | None, tok_hash: torch.Tensor | None,
               use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's best (score float32 [B], global id int64 [B]) per row. logits [B, >= size]
    (the rank's columns; any past `shard.size` are padding); temps None: every row greedy, the
    score is the logit (exact in float32 from bf16/fp16), seeds unread; else
    `ops.gumbel_best`'s scores."""
    batch = logits.shape[0]
    if shard.size == 0:  # a last rank holding only padding never wins (unless all are -inf)
        return (torch.full((batch,), -math.inf, dtype=torch.float32, device=logits.device),
                torch.full((batch,), shard.start, dtype=torch.int64, device=logits.device))
    x = logits[:, : shard.size]
    if temps is None and use_triton:
        from ..kernels import sampling as kern

        return kern.argmax_best(x, id_offset=shard.start)
    if temps is None:
        idx = x.argmax(dim=1, keepdim=True)
        return x.gather(1, idx).squeeze(1).to(torch.float32), idx.squeeze(1) + shard.start
    if seeds is None:
        raise ValueError("a draw with temperatures needs the rows' seeds")
    return ops.gumbel_best(x, seeds, positions, tok_hash, temps=temps, id_offset=shard.start,
                           use_triton=use_triton)


def pick_best(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The winner of every row over the ranks: scores float32 and ids int64 [R, B] in rank order
    (rank r's ids are all below rank r+1's). argmax keeps the first maximum: the lowest rank, so
    the lowest id, on a tie."""
    best = scores.argmax(dim=0, keepdim=True)
    return ids.gather(0, best).squeeze(0)


def pack(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B, 2] float64 of one rank's (score, id), one message: both convert exactly (float32
    widens, and ids are far below 2**53)."""
    return torch.stack([scores.to(torch.float64), ids.to(torch.float64)], dim=1)


def pick_packed(gathered: torch.Tensor) -> torch.Tensor:
    """`pick_best` over the ranks' packs stacked as [R, B, 2]."""
    return pick_best(gathered[..., 0], gathered[..., 1].to(torch.int64))


# Token ids travel as float32 through the all-reduce: exact below 2**24.
FLOAT32_EXACT_IDS = 1 << 24


def exchange_best(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The `Combine` of a TP group: every rank's pairs on every rank, then the same pick on
    every rank (the same bytes, the same deterministic ops). On GPUs with the one-shot
    all-reduce (kernels/all_reduce.py) the pairs go as an all-gather by all-reduce: each rank
    fills its slot of a zeroed [ranks, B, 2] fp32 buffer and the sum is exact (a few small
    launches, cheaper than an NCCL all-gather of so few bytes); else one NCCL/gloo all-gather
    of [B, 2] float64 packs. The caller keeps ids below FLOAT32_EXACT_IDS."""
    state = dist.tp()
    fast = state.fast_all_reduce
    if fast is not None and scores.is_cuda:
        from ..kernels import sampling as kern

        buf = kern.pack_slot(scores, ids, state.rank, state.size)
        if fast.supports(buf):
            return kern.pick_ranks(fast(buf))
    return pick_packed(dist.all_gather_stack(pack(scores, ids)))
