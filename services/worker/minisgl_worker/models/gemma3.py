"""Gemma 3 (text): local sliding-window layers interleaved with global ones, each kind with its
own RoPE (ModelConfig.sliding_rope); per-head q/k norms; four norms a layer, the attention's and
the MLP's outputs normed before the residual add ("sandwich"), all scaling by (1 + w);
embeddings times sqrt(hidden_size); GeGLU; softmax scale query_pre_attn_scalar ** -0.5; the
output logits soft-capped where the config sets final_logit_softcapping. The per-layer windows
come from the base class (`attention_layers`: ModelConfig.layer_window). The config is made
flat by gemma3_config.py, which also refuses what is not computed here (attn_logit_softcapping
among them: transformers' Gemma 3 never applies it).

Gemma3ForConditionalGeneration checkpoints serve their language model only: its tensors are
mapped from the multimodal prefixes, the vision tower's and projector's are skipped.
"""

from __future__ import annotations

from typing import Any

from ..model_config import ModelConfig
from .decoder import CausalLM

# Multimodal checkpoint prefix -> ours: the layout of transformers' state dicts since 4.52
# (model.language_model.*), then that of the public checkpoints, which transformers 5 also saves
# (language_model.model.*).
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                    "multi_modal_projector.")


def _cap(cfg: ModelConfig, key: str) -> float | None:
    value = cfg.raw.get(key)
    return float(value) if value is not None else None


class Gemma3ForCausalLM(CausalLM):
    qkv_bias = False
    qk_norm = True
    sandwich_norms = True
    norm_unit_offset = True
    scale_embeddings = True
    mlp_activation = "gelu_tanh"

    @classmethod
    def attention_scale(cls, cfg: ModelConfig) -> float:
        return float(cfg.raw["query_pre_attn_scalar"]) ** -0.5

    @classmethod
    def final_logit_softcap(cls, cfg: ModelConfig) -> float | None:
        return _cap(cfg, "final_logit_softcapping")


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """(gemma3_config.py refuses a final_logit_softcapping here: transformers 5 ignores it for
    this class, older versions applied it.)"""

    def skip_reason(self, name: str) -> str | None:
        if name.startswith(_VISION_PREFIXES):
            return "the vision tower and projector (text-only serving)"
        return None

    def weight_target(self, name: str) -> tuple[str, Any] | None:
        for prefix, ours in _TEXT_PREFIXES:
            if name.startswith(prefix):
                return super().weight_target(ours + name[len(prefix):])
        return super().weight_target(name)  # lm_head.weight; anything else stays unmatched
