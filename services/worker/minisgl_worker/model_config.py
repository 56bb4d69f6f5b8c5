"""The parts of a HF `config.json` the models read, normalised across transformers versions.

Public checkpoints write `rope_theta` / `rope_scaling` and `num_experts`; configs saved by
transformers 5 write `rope_parameters` and may write `num_local_experts`. Both are accepted, and
so is `rope_parameters` keyed by layer type (Gemma 3: {"full_attention": {...},
"sliding_attention": {...}}). Gemma 3 configs are first made flat by gemma3_config.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import gemma3_config
from .prequant import CheckpointQuant, checkpoint_quant


def refuse_quantized(d: dict[str, Any]) -> CheckpointQuant | None:
    """A checkpoint quantized by its publisher loads only in the FP8 formats prequant.py
    implements; any other (AWQ, GPTQ, MXFP4, int or packed compressed-tensors, an fp8 setting
    not implemented) stores weights this engine cannot read: computing with them as if they were
    bf16 would answer garbage, so start-up stops here, naming the field and its value.
    (`--quantization fp8` quantizes a bf16 checkpoint at load and needs no quantization_config.)"""
    return checkpoint_quant(d)


LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")  # rope_scaling kinds layers/rotary.py computes


def _rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """A rope_scaling dict with its kind under "rope_type", or None for plain RoPE; an unknown
    kind raises, naming it."""
    if scaling is None:
        return None
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    scaling["rope_type"] = kind
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        raise ValueError(f"config.json rope_scaling type {kind!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    return scaling


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None or {"rope_type": "llama3", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: list[int]
    torch_dtype: str | None
    sliding_window: int | None  # only when the model really uses one (Mistral v0.1, Gemma 3)
    # mixture of experts (Qwen3-MoE); num_experts == 0 for dense models
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # per layer "full_attention" or "sliding_attention" (HF `layer_types`); [] : every layer the
    # same, windowed when `sliding_window` is set
    layer_types: list[str] = field(default_factory=list)
    # (rope theta, rope scaling) of the sliding-window layers where the config gives them their
    # own (rope_parameters per layer type); None: every layer uses rope_theta / rope_scaling
    sliding_rope: tuple[float, dict[str, Any] | None] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    # a pre-quantized (FP8) checkpoint's format (prequant.py); None: unquantized weights
    quant: CheckpointQuant | None = None

    def layer_rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """The (theta, scaling) of `layer`'s rotary embedding."""
        if self.sliding_rope is not None and self.layer_window(layer) is not None:
            return self.sliding_rope
        return self.rope_theta, self.rope_scaling

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` in tokens, or None for full attention."""
        if self.layer_types:
            return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % max(1, self.decoder_sparse_step) == 0)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        quant = refuse_quantized(d)
        if gemma3_config.is_gemma3(d):
            d = gemma3_config.text_config(d)
        rope: dict[str, Any] = dict(d.get("rope_parameters") or {})
        sliding_rope = None
        if any(isinstance(rope.get(t), dict) for t in LAYER_TYPES):  # one per layer type
            unknown_types = sorted(set(rope) - set(LAYER_TYPES))
            if unknown_types:
                raise ValueError(f"config.json rope_parameters {unknown_types[0]!r} is not a "
                                 f"layer type (supported: {', '.join(LAYER_TYPES)})")
            local = dict(rope.get("sliding_attention") or {})
            rope = dict(rope.get("full_attention") or {})
            sliding_rope = (float(local.get("rope_theta", 10000.0)),
                            _rope_scaling({k: v for k, v in local.items() if k != "rope_theta"}))
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = _rope_scaling(d.get("rope_scaling") or (
            {k: v for k, v in rope.items() if k != "rope_theta"} if rope else None))
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        uses_window = d.get("use_sliding_window", True) and d.get("sliding_window")
        layer_types = list(d.get("layer_types") or [])
        unknown = sorted({t for t in layer_types} - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"config.json layer_types {unknown[0]!r} is not supported "
                             f"(supported: {', '.join(LAYER_TYPES)})")
        if layer_types and len(layer_types) != d["num_hidden_layers"]:
            raise ValueError(f"config.json layer_types has {len(layer_types)} entries for "
                             f"{d['num_hidden_layers']} layers")
        if uses_window and not layer_types and isinstance(d.get("max_window_layers"), int):
            # Qwen2-style configs without layer_types: the window starts at max_window_layers
            # (the layers below it attend fully), as transformers derives it.
            first = d["max_window_layers"]
            layer_types = ["sliding_attention" if i >= first else "full_attention"
                           for i in range(d["num_hidden_layers"])]
        if "sliding_attention" in layer_types and not uses_window:
            # HF configs keep the types when the window is switched off (Qwen2's
            # use_sliding_window: false): every layer then attends fully.
            layer_types = []
        return cls(
            architecture=archs[0],
            hidden_size=d["hidden_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            intermediate_size=d.get("intermediate_size", 0),
            vocab_size=d["vocab_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            eos_token_ids=[int(x) for x in eos_ids],
            torch_dtype=d.get("torch_dtype", d.get("dtype")),
            sliding_window=int(uses_window) if uses_window else None,
            num_experts=d.get("num_experts") or d.get("num_local_experts") or 0,
            num_experts_per_tok=d.get("num_experts_per_tok", 0),
            moe_intermediate_size=d.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=d.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=list(d.get("mlp_only_layers") or []),
            layer_types=layer_types,
            sliding_rope=sliding_rope,
            raw=d,
            quant=quant,
        )

    @classmethod
    def load(cls, model_path: str | Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
        path = Path(model_path) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json in {model_path}")
        d = json.loads(path.read_text())
        d.update(overrides or {})
        cfg = cls.from_dict(d)
        # generation_config.json often lists more end tokens (Llama 3 instruct: eot_id).
        gen = Path(model_path) / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            extra = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
            cfg.eos_token_ids = sorted({*cfg.eos_token_ids, *map(int, extra)})
        return cfg
