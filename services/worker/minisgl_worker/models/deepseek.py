"""DeepSeek-V2 / V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): the shared decoder with
multi-head latent attention (layers/mla.py, a compressed KV cache) and DeepSeek's MoE
(layers/deepseek_moe.py: shared experts, V2 softmax / V3 sigmoid + bias routing), as HF
transformers' deepseek_v2 / deepseek_v3 compute them.

Layer i has the MoE block when i >= first_k_dense_replace and i % moe_layer_freq == 0 (HF reads
only the first condition; the reference code of both models reads both, and every public
config has moe_layer_freq 1), a dense SwiGLU MLP otherwise. Multi-token-prediction layers
(indices >= num_hidden_layers, `num_nextn_predict_layers`) are not served: the loader skips them
and logs it. Config fields this engine does not implement stop start-up, naming them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from ..attention.base import LayerAttention
from ..attention.kv_pool import KVLayout
from ..layers.deepseek_moe import DeepseekMoeBlock, RouterSpec
from ..layers.mla import MultiLatentAttention
from ..layers.mlp import GatedMLP
from ..model_config import ModelConfig
from .decoder import CausalLM
from .qwen3_moe import expert_target


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class DeepseekConfig:
    """The DeepSeek fields of config.json (HF's defaults for the version where one is absent)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool
    n_routed_experts: int
    n_shared_experts: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    router: RouterSpec | None  # None: no routed experts (every layer dense)

    @classmethod
    def of(cls, cfg: ModelConfig) -> DeepseekConfig:
        d, v3 = cfg.raw, cfg.architecture == "DeepseekV3ForCausalLM"
        for name, ok in (("attention_bias", not d.get("attention_bias")),
                         ("mlp_bias", not d.get("mlp_bias")),
                         ("hidden_act", d.get("hidden_act", "silu") == "silu")):
            if not ok:
                raise ValueError(f"config.json {name}={d.get(name)!r} is not supported for "
                                 f"{cfg.architecture}")
        if not v3 and d.get("norm_topk_prob"):
            # HF's DeepseekV2TopkRouter never renormalises; the reference code would: refuse
            # rather than pick one.
            raise ValueError("config.json norm_topk_prob=true is not supported for "
                             "DeepseekV2ForCausalLM (HF transformers ignores it)")
        experts = int(d.get("n_routed_experts") or 0)
        router = None
        if experts:
            default_method = "noaux_tc" if v3 else "greedy"
            router = RouterSpec(
                num_experts=experts, top_k=int(d["num_experts_per_tok"]),
                scoring=d.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
                method=d.get("topk_method") or default_method,
                n_group=int(d.get("n_group") or (8 if v3 and "n_group" not in d else 1)),
                topk_group=int(d.get("topk_group") or (4 if v3 and "topk_group" not in d
                                                       else 1)),
                norm_topk_prob=bool(d.get("norm_topk_prob", v3)),
                scaling=float(d.get("routed_scaling_factor", 2.5 if v3 else 1.0)))
        return cls(
            q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=int(d["kv_lora_rank"]),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]), v_head_dim=int(d["v_head_dim"]),
            # HF's V2 always rotates interleaved pairs; V3 has the switch.
            rope_interleaved=bool(d.get("rope_interleave", True)) if v3 else True,
            n_routed_experts=experts, n_shared_experts=int(d.get("n_shared_experts") or 0),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
            first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(d.get("moe_layer_freq") or 1), router=router)

    def is_moe_layer(self, layer: int) -> bool:
        return (self.router is not None and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)


class DeepseekV2ForCausalLM(CausalLM):
    qkv_bias: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = False

    @classmethod
    def attention_layers(cls, cfg: ModelConfig) -> tuple[LayerAttention, ...]:
        ds = DeepseekConfig.of(cfg)
        return tuple(LayerAttention(value_dim=ds.kv_lora_rank) for _ in range(cfg.num_layers))

    @classmethod
    def attention_scale(cls, cfg: ModelConfig) -> float:
        """(qk_nope + qk_rope) ** -0.5, times mscale ** 2 where the rope scaling sets
        mscale_all_dim (HF's yarn_apply_mscale). The YaRN attention factor (mscale /
        mscale_all_dim terms) is in the rotary's cos/sin already."""
        ds = DeepseekConfig.of(cfg)
        scale = float(ds.qk_nope_head_dim + ds.qk_rope_head_dim) ** -0.5
        scaling = cfg.rope_scaling or {}
        mscale_all_dim = scaling.get("mscale_all_dim")
        if mscale_all_dim:
            factor = scaling.get("factor")
            if factor is None:
                raise ValueError("config.json rope_scaling sets mscale_all_dim without factor")
            m = _yarn_mscale(float(factor), float(mscale_all_dim))
            scale *= m * m
        return scale

    @classmethod
    def kv_layout(cls, cfg: ModelConfig) -> KVLayout:
        """The normed latent and the rotary key: one head, kv_lora_rank + qk_rope_head_dim."""
        ds = DeepseekConfig.of(cfg)
        return KVLayout(1, ds.kv_lora_rank + ds.qk_rope_head_dim, v_dim=ds.kv_lora_rank)

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        self.ds = DeepseekConfig.of(cfg)
        super().__init__(cfg, max_positions)

    def rotary_dim(self, cfg: ModelConfig) -> int:
        return self.ds.qk_rope_head_dim

    def make_attention(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        ds = self.ds
        return MultiLatentAttention(
            layer_id, cfg.hidden_size, cfg.num_heads, ds.q_lora_rank, ds.kv_lora_rank,
            ds.qk_nope_head_dim, ds.qk_rope_head_dim, ds.v_head_dim, cfg.rms_norm_eps,
            self.rotary, ds.rope_interleaved)

    def make_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        ds = self.ds
        if not ds.is_moe_layer(layer_id):
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        assert ds.router is not None
        return DeepseekMoeBlock(cfg.hidden_size, ds.moe_intermediate_size, ds.router,
                                ds.n_shared_experts)

    def weight_target(self, name: str) -> tuple[str, Any] | None:
        if ".self_attn." in name and "rotary_emb" not in name:
            return name, None  # q_proj is DeepSeek's own, not part of a packed qkv
        return expert_target(name) or super().weight_target(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
