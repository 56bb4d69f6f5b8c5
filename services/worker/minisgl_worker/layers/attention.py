"""Self-attention: packed QKV projection, optional per-head q/k RMSNorm (Qwen3, Gemma 3), rotary,
the step's attention backend, output projection (optionally biased), optional per-head attention
sinks (gpt-oss). Heads are split across TP ranks."""

from __future__ import annotations

import torch
from torch import nn

from ..attention.base import AttentionBackend
from ..distributed import shard, tp
from ..fp8 import Fp8Rows
from ..kernels import fused_ops
from .linear import ColumnParallelLinear, RowParallelLinear
from .norm import RMSNorm
from .rotary import RotaryEmbedding
from .weights import WeightSource, check_shape, read, set_loader, src_shape


class SelfAttention(nn.Module):
    def __init__(self, layer_id: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, rotary: RotaryEmbedding, qkv_bias: bool = False,
                 qk_norm_eps: float | None = None, o_bias: bool = False,
                 sinks: bool = False, norm_unit_offset: bool = False) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = shard(num_heads, "num_attention_heads")
        self.num_kv_heads = shard(num_kv_heads, "num_key_value_heads")
        self.head_dim = head_dim
        self.qkv_proj = ColumnParallelLinear(
            hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:  # Gemma's scale by (1 + w): norm_unit_offset
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, norm_unit_offset)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, norm_unit_offset)
        # A list: shared by the layers of one kind (Gemma 3's local and global layers each have
        # their own), not a submodule of each. The fused prologue reads this one too.
        self.rotary = [rotary]
        # Attention sinks (gpt-oss): one learned logit per head, [num_heads] of this rank's heads,
        # handed to the backend with every call. fp32 whatever the model dtype: the backends
        # take them so (a bf16 checkpoint's values convert exactly).
        self.sinks: torch.Tensor | None = None
        if sinks:
            self.num_heads_total = num_heads
            self.sinks = set_loader(nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32),
                                                 requires_grad=False), self._load_sinks)

    def _load_sinks(self, param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
        check_shape("self_attn.sinks", src_shape(src), (self.num_heads_total,))
        n = self.num_heads
        param.data.copy_(read(src, 0, tp().rank * n, n))

    def defer_reduction(self) -> None:
        self.o_proj.defer_reduction()

    def forward(self, positions: torch.Tensor, x: torch.Tensor | Fp8Rows,
                attn: AttentionBackend) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, d)
        k = k.reshape(t, self.num_kv_heads, d)
        v = v.reshape(t, self.num_kv_heads, d)
        # On CUDA q/k norm, rotary and the KV store are one kernel (four or five small launches
        # a layer otherwise, a large share of a small model's decode step). It writes where the
        # backend's own store would (store_loc: the static buffer under CUDA graphs).
        loc = attn.store_loc() if fused_ops.usable(q) else None
        if loc is not None:
            self._fused_prologue(positions, q, k, v, attn, loc)
            out = attn.forward(q, k, v, self.layer_id, kv_stored=True, sinks=self.sinks)
            return self.o_proj(out.reshape(t, q_size))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        out = attn.forward(q, k, v, self.layer_id, sinks=self.sinks)
        return self.o_proj(out.reshape(t, q_size))

    def _fused_prologue(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, attn: AttentionBackend, loc: torch.Tensor) -> None:
        """q, k normed (Qwen3) and rotated in place; k, v written into this layer's KV cache."""
        rope, pool = self.rotary[0], attn.pool
        qw = kw = None
        eps = 0.0
        if self.q_norm is not None and self.k_norm is not None:
            qw, kw, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        fused_ops.qk_norm_rope_store_(q, k, v, positions, rope.cos, rope.sin,
                                      pool.k[self.layer_id], pool.v[self.layer_id], loc,
                                      q_weight=qw, k_weight=kw, eps=eps)
