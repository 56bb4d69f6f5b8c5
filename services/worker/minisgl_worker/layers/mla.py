"""DeepSeek's multi-head latent attention (MLA), computed in the absorbed form over a compressed
KV cache.

Per token, kv_a_proj_with_mqa gives a latent c (kv_lora_rank values, then RMS-normed) and one
rotary key k_pe (qk_rope_head_dim values) shared by every head. The cache holds only [c, k_pe]:
one KV "head" of kv_lora_rank + qk_rope_head_dim values a layer (KVPool's MLA mode). HF expands
c through kv_b_proj into each head's k_nope = W_UK[h] c and v = W_UV[h] c; here the
expansion is folded into the query and the output instead:

    q_nope . k_nope = (W_UK[h]^T q_nope) . c          sum_j p_j v_j = W_UV[h] (sum_j p_j c_j)

so the backend attends q = [W_UK[h]^T q_nope, q_pe] (per head) to k = [c, k_pe] (one head, MQA)
with V = c (K's first kv_lora_rank values), and the latent output is multiplied by each head's
W_UV before o_proj. The softmax scale is the model's (`CausalLM.attention_scale`).

RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (GPT-J layout); our rotary is
rotate-half. Permuting each rotary block to [x0, x2, ..., x1, x3, ...] turns one into the other,
and q_pe . k_pe is unchanged when both are permuted alike: so the rotary rows of q_proj /
q_b_proj (per head) and of kv_a_proj_with_mqa are permuted at load (`interleaved=True`), and the
cache holds the permuted k_pe.

TP: the query heads (q_proj / q_b_proj rows, kv_b_proj rows, o_proj columns) are split over the
ranks; the latent projections (q_a_proj, kv_a_proj_with_mqa and their norms) are replicated,
and so is the cache's latent head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention.base import AttentionBackend
from ..distributed import shard, tp
from .linear import ColumnParallelLinear, ReplicatedProjection, RowParallelLinear
from .norm import RMSNorm
from .rotary import RotaryEmbedding
from .weights import WeightSource, check_shape, new_param, read, set_loader, src_shape


def deinterleave(rope_dim: int) -> torch.Tensor:
    """The row order that makes interleaved pairs rotate-half halves: evens, then odds."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def permute_rope_rows(param: nn.Parameter, head_dim: int, rope_dim: int) -> None:
    """Reorder the last `rope_dim` rows of every `head_dim`-row block of `param` in place."""
    order = deinterleave(rope_dim).to(param.device)
    blocks = param.data.view(-1, head_dim, *param.shape[1:])
    rope = blocks[:, head_dim - rope_dim:]
    rope.copy_(rope[:, order].clone())


def _permuting(param: nn.Parameter, head_dim: int, rope_dim: int) -> nn.Parameter:
    """Wrap `param`'s loader: after each load, the rotary rows are permuted."""
    inner = param.weight_loader  # type: ignore[attr-defined]

    def load(p: nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
        inner(p, src, shard_id)
        permute_rope_rows(p, head_dim, rope_dim)

    # Read by pre-quantized fp8 loading: per-row scales follow their rows (quant_load/fp8_mla.py)
    load.rope_rows = (head_dim, rope_dim)  # type: ignore[attr-defined]
    return set_loader(param, load, param.num_shards)  # type: ignore[attr-defined]


class LatentUpProjection(nn.Module):
    """kv_b_proj [heads * (qk_nope + v), kv_lora_rank], this rank's heads, used per head as
    W_UK (the first qk_nope rows) and W_UV (the next v rows). A plain weight, not a Linear:
    it is never applied as HF applies it, and stays as loaded under --quantization fp8."""

    def __init__(self, num_heads: int, nope_dim: int, v_dim: int, kv_lora_rank: int) -> None:
        super().__init__()
        self.heads, self.nope, self.v_dim, self.rank = num_heads, nope_dim, v_dim, kv_lora_rank
        self.local = shard(num_heads, "num_attention_heads")
        self.weight = set_loader(new_param(self.local * (nope_dim + v_dim), kv_lora_rank),
                                 self._load)

    def _load(self, param: nn.Parameter, src: WeightSource, shard_id: Any = None) -> None:
        rows = self.nope + self.v_dim
        check_shape("kv_b_proj", src_shape(src), (self.heads * rows, self.rank))
        n = self.local * rows
        param.data.copy_(read(src, 0, tp().rank * n, n))

    def _per_head(self) -> torch.Tensor:
        return self.weight.view(self.local, self.nope + self.v_dim, self.rank)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, qk_nope] -> [T, H, kv_lora_rank]: W_UK[h]^T q_nope[h]."""
        w_uk = self._per_head()[:, :self.nope]  # [H, nope, rank]
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def expand_output(self, latent: torch.Tensor) -> torch.Tensor:
        """[T, H, kv_lora_rank] -> [T, H, v]: W_UV[h] o[h]."""
        w_uv = self._per_head()[:, self.nope:]  # [H, v, rank]
        return torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


class MultiLatentAttention(nn.Module):
    def __init__(self, layer_id: int, hidden_size: int, num_heads: int, q_lora_rank: int | None,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, eps: float, rotary: RotaryEmbedding, interleaved: bool) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = shard(num_heads, "num_attention_heads")
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_lora_rank = kv_lora_rank
        qk = qk_nope_head_dim + qk_rope_head_dim
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: ReplicatedProjection | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, [num_heads * qk])
            q_out = self.q_proj
        else:
            self.q_a_proj = ReplicatedProjection(hidden_size, q_lora_rank)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, [num_heads * qk])
            q_out = self.q_b_proj
        self.kv_a_proj_with_mqa = ReplicatedProjection(hidden_size,
                                                       kv_lora_rank + qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = LatentUpProjection(num_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank)
        self.o_proj = RowParallelLinear(num_heads * v_head_dim, hidden_size)
        if interleaved:
            _permuting(q_out.weight, qk, qk_rope_head_dim)
            _permuting(self.kv_a_proj_with_mqa.weight, kv_lora_rank + qk_rope_head_dim,
                       qk_rope_head_dim)
        self.rotary = [rotary]  # a list: shared by every layer, not a submodule of each

    def defer_reduction(self) -> None:
        self.o_proj.defer_reduction()

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, h, self.nope + self.rope).split([self.nope, self.rope], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], -1)
        latent = self.kv_a_layernorm(latent.contiguous())
        # Contiguous copies: on CUDA the rotary kernel turns them in place.
        q_pe, k_pe = self.rotary[0](positions, q_pe.contiguous(),
                                    k_pe.reshape(t, 1, self.rope).contiguous())
        q_full = torch.cat([self.kv_b_proj.absorb_query(q_nope), q_pe], dim=-1)
        k_full = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)  # [T, 1, rank + rope]
        out = attn.forward(q_full, k_full, k_full[..., :self.kv_lora_rank], self.layer_id)
        out = self.kv_b_proj.expand_output(out)  # [T, H, v]
        return self.o_proj(out.reshape(t, h * self.v_dim))
