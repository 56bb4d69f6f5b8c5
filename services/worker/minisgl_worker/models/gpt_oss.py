"""gpt-oss (20b, 120b), bf16 experts: biases on q, k, v and o; a learned attention-sink logit per
head (`self_attn.sinks`); sliding-window (`sliding_window`, 128) and full-attention layers
alternating as `layer_types` says (HF's default when absent: even layers sliding); YaRN RoPE from
the config; every layer a sparse MoE block (layers/gpt_oss_moe.py: router with a bias, top-k of
the logits then softmax, experts with biases and the clamped SwiGLU). OpenAI's checkpoints store
the experts in MXFP4 (`*_blocks` / `*_scales`, quant/mxfp4.py): they fill the block's w13 / w2
and their `_scale`s once quant_load/mxfp4.py has turned those into MXFP4 parameters."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from torch import nn

from ..attention.base import LayerAttention
from ..kernels.clamped_swiglu import ClampedSwiGLU
from ..layers.gpt_oss_moe import GptOssMoeBlock
from ..model_config import ModelConfig
from .decoder import CausalLM

_ROUTER_RE = re.compile(r"^(.*\.mlp\.)router\.(weight|bias)$")
_EXPERTS_RE = re.compile(r"^(.*\.mlp\.)experts\.((gate_up|down)_proj(_bias|_blocks|_scales)?)$")
_EXPERT_PARAM = {"gate_up_proj": "w13", "gate_up_proj_bias": "w13_bias", "down_proj": "w2",
                 "down_proj_bias": "w2_bias",
                 # MXFP4 experts (quant_load/mxfp4.py): packed codes and e8m0 scales
                 "gate_up_proj_blocks": "w13", "gate_up_proj_scales": "w13_scale",
                 "down_proj_blocks": "w2", "down_proj_scales": "w2_scale"}


def default_layer_types(num_layers: int) -> list[str]:
    """HF GptOssConfig's layer_types when config.json has none: sliding first, alternating."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


class GptOssForCausalLM(CausalLM):
    qkv_bias = True
    qk_norm = False
    o_bias = True
    attention_sinks = True

    @classmethod
    def attention_layers(cls, cfg: ModelConfig) -> tuple[LayerAttention, ...]:
        if not cfg.layer_types and cfg.sliding_window is not None:
            cfg = dataclasses.replace(cfg, layer_types=default_layer_types(cfg.num_layers))
        return super().attention_layers(cfg)

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        if not cfg.attention_bias:  # the layers below always carry the biases
            raise ValueError("gpt-oss config.json attention_bias=false is not supported")
        if cfg.num_experts <= 0 or cfg.num_experts_per_tok <= 0:
            raise ValueError("gpt-oss config.json needs num_local_experts and "
                             "num_experts_per_tok")
        super().__init__(cfg, max_positions)

    def make_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        act = ClampedSwiGLU(alpha=float(cfg.raw.get("swiglu_alpha", 1.702)),
                            limit=float(cfg.raw.get("swiglu_limit", 7.0)))
        block = GptOssMoeBlock(cfg.hidden_size, cfg.intermediate_size, cfg.num_experts,
                               cfg.num_experts_per_tok, act)
        if cfg.quant is not None and cfg.quant.scheme == "mxfp4":
            block.release_experts()  # quant_load/mxfp4.py allocates what the checkpoint holds
        return block

    def weight_target(self, name: str) -> tuple[str, Any] | None:
        m = _ROUTER_RE.match(name)
        if m:
            return f"{m.group(1)}gate.{m.group(2)}", None
        m = _EXPERTS_RE.match(name)
        if m:
            return f"{m.group(1)}{_EXPERT_PARAM[m.group(2)]}", None
        return super().weight_target(name)
