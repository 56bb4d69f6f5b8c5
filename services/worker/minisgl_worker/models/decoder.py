"""The decoder-only transformer every supported architecture shares.

embed -> N x [RMSNorm -> attention -> residual -> RMSNorm -> MLP/MoE -> residual] -> RMSNorm
-> LM head. Architectures differ only in small switches (QKV and o biases, per-head q/k norm,
attention sinks, the MLP kind; Gemma's sandwich norms, (1 + w) norm scales, scaled embeddings,
GeGLU, logit soft-cap; another attention module: DeepSeek's latent attention), set by the
subclasses in llama.py, qwen2.py, qwen3.py, qwen3_moe.py, gpt_oss.py, gemma3.py and
deepseek.py. Parameter names follow the HF checkpoints, except for packed ones (qkv_proj,
gate_up_proj, MoE w13/w2), which `weight_target` maps.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, cast

import torch
from torch import nn

from ..attention.base import AttentionBackend, LayerAttention
from ..attention.kv_pool import KVLayout
from ..distributed import tp
from ..layers.attention import SelfAttention
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.mlp import GatedMLP
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..model_config import ModelConfig

# HF name of a packed part -> (our packed module, shard id)
_PACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_PACKED_RE = re.compile(r"^(.*\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


class DecoderLayer(nn.Module):
    """sandwich (Gemma 2/3): the attention's and the MLP's outputs are normed before their
    residual add (post_attention_layernorm, post_feedforward_layernorm), and the MLP's input has
    its own norm (pre_feedforward_layernorm). Otherwise post_attention_layernorm is the MLP's
    input norm, as in Llama. unit_offset: every norm scales by (1 + w) (RMSNorm)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, mlp: nn.Module,
                 qkv_bias: bool, qk_norm: bool, o_bias: bool = False,
                 sinks: bool = False, attention: nn.Module | None = None,
                 sandwich: bool = False, unit_offset: bool = False) -> None:
        """`attention`: another attention module (same forward signature as SelfAttention,
        e.g. DeepSeek's latent attention); None: SelfAttention."""
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset)

        self.input_layernorm = norm()
        self.self_attn = attention if attention is not None else SelfAttention(
            layer_id, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary,
            qkv_bias=qkv_bias, qk_norm_eps=cfg.rms_norm_eps if qk_norm else None,
            o_bias=o_bias, sinks=sinks, norm_unit_offset=unit_offset)
        self.post_attention_layernorm = norm()
        self.sandwich = sandwich
        if sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = mlp
        # TP: attention's and the MLP's row-parallel outputs stay partial sums; the norm after
        # each sums them over the ranks together with its residual add (one kernel on GPUs with
        # the custom all-reduce). The MLP's output is summed by the next layer's input norm, or
        # the model's final norm. A sandwich layer's post-norms need the full sums: its
        # projections reduce their own outputs, and it hands on reduced hidden states.
        self.reduce = tp().size > 1 and not sandwich
        if self.reduce:
            cast(Any, self.self_attn).defer_reduction()
            cast(Any, self.mlp).defer_reduction()

    @property
    def mlp_input_norm(self) -> str:
        """The name of the norm whose output is the MLP's input (fp8 quantization feeds it)."""
        return "pre_feedforward_layernorm" if self.sandwich else "post_attention_layernorm"

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        # With fp8 projections the norms may hand over quantized rows (Fp8FeedingRMSNorm,
        # swapped in by quantize.py).
        if residual is None:  # x: the embeddings (summed over the ranks already)
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual, reduce=self.reduce)
        h = self.self_attn(positions, h, attn)
        if not self.sandwich:
            h, residual = self.post_attention_layernorm.add_forward(h, residual,
                                                                    reduce=self.reduce)
            return self.mlp(h), residual
        h = cast(torch.Tensor, self.post_attention_layernorm(h))
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual)
        # the next layer's input norm (or the final norm) adds it to the residual
        return cast(torch.Tensor, self.post_feedforward_layernorm(self.mlp(h))), residual


class DecoderModel(nn.Module):
    embed_scale: torch.Tensor | None  # a buffer, typed for readers

    def __init__(self, cfg: ModelConfig, layers: list[DecoderLayer], unit_offset: bool = False,
                 embed_scale: float | None = None) -> None:
        """embed_scale (Gemma: sqrt(hidden_size)): multiplies the embeddings, rounded to the
        activation dtype first as transformers does."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset)
        scale = None
        if embed_scale is not None:
            scale = torch.tensor(embed_scale, dtype=torch.float32).to(torch.get_default_dtype())
        self.register_buffer("embed_scale", scale, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            h = h * self.embed_scale
        for layer in self.layers:
            h, residual = layer(positions, h, residual, attn)
        assert residual is not None
        # the last layer's MLP output is a partial sum, unless the layer reduced it (sandwich)
        reduce = cast(DecoderLayer, self.layers[-1]).reduce
        return cast(torch.Tensor, self.norm.add_forward(h, residual, reduce=reduce)[0])  # no fp8


class CausalLM(nn.Module):
    """Subclasses set the switches and, when needed, `make_mlp` / `weight_target`, and the
    attention they compute (`attention_layers`, `attention_scale`)."""

    qkv_bias: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = False
    o_bias: ClassVar[bool] = False
    attention_sinks: ClassVar[bool] = False  # a learned sink logit per head (self_attn.sinks)
    # Gemma: norms after attention and MLP too (DecoderLayer's sandwich), norm scales (1 + w),
    # embeddings times sqrt(hidden_size), GeGLU
    sandwich_norms: ClassVar[bool] = False
    norm_unit_offset: ClassVar[bool] = False
    scale_embeddings: ClassVar[bool] = False
    mlp_activation: ClassVar[str] = "silu"

    @classmethod
    def attention_layers(cls, cfg: ModelConfig) -> tuple[LayerAttention, ...]:
        """What each layer's attention computes beyond plain causal attention (the backends
        check they can serve it at start-up): a sliding window where the config sets one,
        sinks where the architecture has them."""
        return tuple(LayerAttention(window=cfg.layer_window(i), sinks=cls.attention_sinks)
                     for i in range(cfg.num_layers))

    @classmethod
    def attention_scale(cls, cfg: ModelConfig) -> float:
        """The softmax scale of every layer."""
        return float(cfg.head_dim) ** -0.5

    @classmethod
    def kv_layout(cls, cfg: ModelConfig) -> KVLayout:
        """What the KV cache holds per token and layer: K and V of every KV head."""
        return KVLayout(cfg.num_kv_heads, cfg.head_dim)

    @classmethod
    def final_logit_softcap(cls, cfg: ModelConfig) -> float | None:
        """logits -> cap * tanh(logits / cap) where the model caps its output logits."""
        return None

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = RotaryEmbedding(self.rotary_dim(cfg), max_positions, cfg.rope_theta,
                                      cfg.rope_scaling, cfg.max_position_embeddings)
        # Sliding-window layers with a RoPE of their own (Gemma 3's local layers).
        self.sliding_rotary: RotaryEmbedding | None = None
        if cfg.sliding_rope is not None:
            theta, scaling = cfg.sliding_rope
            self.sliding_rotary = RotaryEmbedding(cfg.head_dim, max_positions, theta, scaling,
                                                  cfg.max_position_embeddings)
        layers = [DecoderLayer(cfg, i, self.layer_rotary(i), self.make_mlp(cfg, i),
                               self.qkv_bias, self.qk_norm, self.o_bias, self.attention_sinks,
                               self.make_attention(cfg, i), self.sandwich_norms,
                               self.norm_unit_offset) for i in range(cfg.num_layers)]
        embed_scale = float(cfg.hidden_size) ** 0.5 if self.scale_embeddings else None
        self.model = DecoderModel(cfg, layers, self.norm_unit_offset, embed_scale)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.lm_head.softcap = self.final_logit_softcap(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def layer_rotary(self, layer_id: int) -> RotaryEmbedding:
        """The rotary embedding of a layer: cfg.layer_rope's."""
        if self.sliding_rotary is not None and self.cfg.layer_rope(layer_id) is \
                self.cfg.sliding_rope:
            return self.sliding_rotary
        return self.rotary

    def make_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, self.mlp_activation)

    def rotary_dim(self, cfg: ModelConfig) -> int:
        """The dimensions the rotary embedding turns (every one of a head by default)."""
        return cfg.head_dim

    def make_attention(self, cfg: ModelConfig, layer_id: int) -> nn.Module | None:
        """A layer's attention module; None: the standard SelfAttention."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, H] (normed)."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """[N, H] -> logits [N, vocab], fp32 or (fp32=False) in the activation dtype."""
        return self.lm_head(hidden, fp32)

    def compute_local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> this TP rank's vocabulary shard of the logits, in the activation dtype
        (`ParallelLMHead.local_logits`); `gather_logits` makes them `compute_logits(fp32=False)`'s."""
        return self.lm_head.local_logits(hidden)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        return self.lm_head.gather(local)

    def skip_reason(self, name: str) -> str | None:
        """Why a checkpoint tensor this model has no use for is skipped (the loader logs one
        line per reason with the count), or None: weight_target decides."""
        return None

    def weight_target(self, name: str) -> tuple[str, Any] | None:
        """Checkpoint tensor name -> (our parameter name, shard id), or None to skip it."""
        if "rotary_emb" in name:
            return None
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return None  # some tied checkpoints store a copy; the embedding is the source
        m = _PACKED_RE.match(name)
        if m:
            packed, shard_id = _PACKED[m.group(2)]
            return f"{m.group(1)}{packed}.{m.group(3)}", shard_id
        return name, None
