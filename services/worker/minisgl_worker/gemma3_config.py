"""Gemma 3's config.json, turned into the flat text-model dict `ModelConfig.from_dict` reads.

Two layouts reach us: `Gemma3ForCausalLM` (model_type gemma3_text, the text config at the top)
and `Gemma3ForConditionalGeneration` (model_type gemma3: the language model's config nested in
`text_config`, the vision tower's in `vision_config`, which text-only serving ignores). The
public multimodal checkpoints write a sparse `text_config` and rely on transformers' defaults
(head_dim 256, rope_theta 1e6, ...), so those defaults are filled in here, as
`Gemma3TextConfig` has them. Older configs give the local layers' RoPE base as
`rope_local_base_freq` and the layer pattern as `sliding_window_pattern`; transformers 5 writes
`rope_parameters` per layer type and `layer_types`: both become the latter.

Gemma 3 options this engine does not compute stop start-up here, naming the field.
"""

from __future__ import annotations

from typing import Any

GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
GEMMA3_MODEL_TYPES = ("gemma3", "gemma3_text")

# Gemma3TextConfig's defaults (transformers/models/gemma3/configuration_gemma3.py) for the fields
# that change the computation.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "use_bidirectional_attention": False,
}
GLOBAL_THETA, LOCAL_THETA, PATTERN = 1_000_000.0, 10_000.0, 6
GELU_TANH = "gelu_pytorch_tanh"
# Keys of the outer (multimodal) config that describe the whole checkpoint, not the vision part.
_OUTER_KEYS = ("architectures", "torch_dtype", "dtype", "quantization_config",
               "compression_config", "tie_word_embeddings", "eos_token_id")
_TEXT_KEYS = ("layer_types", "sliding_window_pattern", "rope_parameters", "rope_theta",
              "rope_scaling", "rope_local_base_freq")


def is_gemma3(d: dict[str, Any]) -> bool:
    archs = d.get("architectures") or []
    return d.get("model_type") in GEMMA3_MODEL_TYPES or (bool(archs)
                                                         and archs[0] in GEMMA3_ARCHITECTURES)


def text_config(d: dict[str, Any]) -> dict[str, Any]:
    """The flat Gemma 3 text config: defaults filled, layer types and per-type RoPE spelled
    out (`layer_types`, nested `rope_parameters`). Raises on a field we do not compute."""
    if isinstance(d.get("text_config"), dict):
        inner = dict(d["text_config"])
        # The outer config's own keys, and text fields an --hf-overrides put at the top (a
        # multimodal config has none of its own).
        for key in (*_OUTER_KEYS, *TEXT_DEFAULTS, *_TEXT_KEYS):
            if d.get(key) is not None:
                inner[key] = d[key]
        inner.setdefault("model_type", "gemma3_text")
        out = inner
    else:
        out = dict(d)
    for key, value in TEXT_DEFAULTS.items():  # absent only: an explicit null stays (as in HF)
        out.setdefault(key, value)
    _refuse_unsupported(out)
    if not out.get("layer_types"):
        pattern = int(out.get("sliding_window_pattern") or out.get("_sliding_window_pattern")
                      or PATTERN)
        out["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                              for i in range(out["num_hidden_layers"])]
    if "sliding_attention" in out["layer_types"] and not out.get("sliding_window"):
        raise ValueError("config.json sliding_window is null but layer_types has sliding "
                         "layers: Gemma 3 without a window is not supported")
    out["rope_parameters"] = _rope_per_layer_type(out)
    out.pop("rope_theta", None)
    out.pop("rope_scaling", None)
    return out


def _rope_per_layer_type(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What transformers' Gemma3TextConfig makes of the RoPE fields: the global (full attention)
    layers take `rope_theta` and `rope_scaling`, the local (sliding) ones `rope_local_base_freq`
    unscaled, unless `rope_parameters` already gives each type its own."""
    given = d.get("rope_parameters") or {}
    if given and not any(isinstance(given.get(t), dict)
                         for t in ("full_attention", "sliding_attention")):
        # transformers reads a flat one as neither layer type's: ambiguous, so not guessed
        raise ValueError("config.json rope_parameters without per-layer-type entries "
                         "(full_attention / sliding_attention) is not supported for Gemma 3")
    full = dict(given.get("full_attention") or {"rope_type": "default"})
    local = dict(given.get("sliding_attention") or {"rope_type": "default"})
    if d.get("rope_scaling"):
        full.update(d["rope_scaling"])
    full.setdefault("rope_theta", d.get("rope_theta") or GLOBAL_THETA)
    local.setdefault("rope_theta", d.get("rope_local_base_freq") or LOCAL_THETA)
    for rope in (full, local):
        rope.setdefault("rope_type", rope.get("type", "default"))
        if rope["rope_type"] in ("llama3", "yarn"):
            rope.setdefault("original_max_position_embeddings", d["max_position_embeddings"])
    return {"full_attention": full, "sliding_attention": local}


def _refuse_unsupported(d: dict[str, Any]) -> None:
    if d.get("use_bidirectional_attention"):
        raise ValueError("config.json use_bidirectional_attention=true is not supported "
                         "(Gemma 3 is served causal only)")
    if d.get("attention_bias"):
        raise ValueError("config.json attention_bias=true is not supported for Gemma 3 "
                         "(no bias on q/k/v/o projections)")
    act = d.get("hidden_activation")
    if act != GELU_TANH:
        raise ValueError(f"config.json hidden_activation={act!r} is not supported for Gemma 3 "
                         f"(only {GELU_TANH!r})")
    if d.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 never hands it to its attention (Gemma 2 did): which a
        # checkpoint expects is unknowable.
        raise ValueError("config.json attn_logit_softcapping is not supported for Gemma 3 "
                         "(transformers' Gemma 3 ignores it; set it to null to serve without)")
    if d.get("architectures", [None])[0] == "Gemma3ForConditionalGeneration" and \
            d.get("final_logit_softcapping") is not None:
        # Older transformers (whose multimodal model wrapped Gemma3ForCausalLM) capped these
        # logits, transformers 5 does not: which a checkpoint expects is unknowable.
        raise ValueError("config.json text_config.final_logit_softcapping is not supported for "
                         "Gemma3ForConditionalGeneration (transformers versions disagree whether "
                         "it applies)")
