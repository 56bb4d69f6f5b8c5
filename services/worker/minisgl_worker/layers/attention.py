"""Self-attention: packed QKV projection, optional per-head q/k RMSNorm (Qwen3), rotary, the
step's attention backend, output projection. Heads are split across TP ranks."""

from __future__ import annotations

import torch
from torch import nn

from ..attention.base import AttentionBackend
from ..distributed import shard
from .linear import ColumnParallelLinear, RowParallelLinear
from .norm import RMSNorm
from .rotary import RotaryEmbedding


class SelfAttention(nn.Module):
    def __init__(self, layer_id: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, rotary: RotaryEmbedding, qkv_bias: bool = False,
                 qk_norm_eps: float | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = shard(num_heads, "num_attention_heads")
        self.num_kv_heads = shard(num_kv_heads, "num_key_value_heads")
        self.head_dim = head_dim
        self.qkv_proj = ColumnParallelLinear(
            hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.rotary = [rotary]  # a list: shared by every layer, not a submodule of each

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, d)
        k = k.reshape(t, self.num_kv_heads, d)
        v = v.reshape(t, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        out = attn.forward(q, k, v, self.layer_id)
        return self.o_proj(out.reshape(t, q_size))
