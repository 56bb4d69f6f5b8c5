"""Rotary position embedding (HF "rotate_half" layout), with the `rope_scaling` kinds of HF
configs: linear, dynamic NTK, YaRN and Llama 3 (any other stops start-up, naming it).

cos/sin are precomputed in fp32 for every position up to max_positions and gathered per token, so
positions can be arbitrary (chunked prefill, decode) and the lookup is graph-capturable.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..kernels import fused_ops
from ..model_config import ROPE_TYPES


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                    trained_positions: int | None = None, served_positions: int | None = None
                    ) -> torch.Tensor:
    """The inverse frequencies [head_dim / 2] of `rope_parameters` (attention factor dropped)."""
    return rope_parameters(head_dim, theta, scaling, trained_positions, served_positions)[0]


def rope_parameters(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                    trained_positions: int | None = None, served_positions: int | None = None
                    ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], attention factor: what cos and sin are multiplied
    by) for a config's `rope_scaling`, as HF transformers computes them. `trained_positions` is
    the config's max_position_embeddings, `served_positions` the engine's context length (dynamic
    NTK is fixed at it: one set of frequencies for every request, so cached K stays valid).
    A scaling type or field that cannot be honoured raises, naming it."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    if kind not in ROPE_TYPES:
        raise ValueError(f"config.json rope_scaling type {kind!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    partial = float(scaling.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"config.json rope_scaling partial_rotary_factor={partial} is not "
                         "supported (rotary over the whole head only)")
    factor = float(scaling["factor"]) if scaling.get("factor") is not None else None
    if kind == "linear":  # positions slowed down by `factor`
        assert factor is not None, "linear rope_scaling needs a factor"
        return inv / factor, 1.0
    if kind == "dynamic":
        assert factor is not None, "dynamic rope_scaling needs a factor"
        trained = trained_positions or int(scaling.get("original_max_position_embeddings", 0))
        length = max(served_positions or trained, trained)
        if length <= trained:
            return inv, 1.0
        base = theta * ((factor * length / trained) - (factor - 1)) ** (head_dim / (head_dim - 2))
        exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base ** exps), 1.0
    if kind == "yarn":
        return _yarn(inv, head_dim, theta, scaling, factor, trained_positions)
    return _llama3(inv, scaling), 1.0


def _yarn(inv: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any],
          factor: float | None, trained_positions: int | None) -> tuple[torch.Tensor, float]:
    """YaRN: high frequencies kept (extrapolated), low ones interpolated by `factor`, a linear
    ramp between the dimensions that turn `beta_fast` and `beta_slow` times over the original
    context; cos/sin scaled by the attention factor."""
    old = float(scaling["original_max_position_embeddings"])
    if factor is None:  # DeepSeek-style configs give the ratio through the two lengths
        factor = float(trained_positions or old) / old
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        attention = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
                     if mscale and mscale_all else get_mscale(factor))
    fast = float(scaling.get("beta_fast") or 32)
    slow = float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    return inv / factor * (1 - keep) + inv * keep, float(attention)


def _llama3(inv: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    # Long wavelengths (beyond the original context) are slowed by `factor`, short ones kept,
    # and the band in between interpolated smoothly.
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # buffers (register_buffer), typed for readers
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None,
                 trained_positions: int | None = None) -> None:
        """`max_positions`: the engine's context length; `trained_positions`: the config's
        max_position_embeddings (dynamic NTK scales by their ratio)."""
        super().__init__()
        inv, attention = rope_parameters(head_dim, theta, scaling, trained_positions,
                                         max_positions)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv.to(t.device))
        emb = torch.cat([freqs, freqs], dim=-1)
        # YaRN's attention factor multiplies cos and sin, so every kernel applies it for free.
        self.register_buffer("cos", emb.cos() * attention, persistent=False)  # [P, D] fp32
        self.register_buffer("sin", emb.sin() * attention, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D]; positions int64 [T]. On CUDA q and k are rotated in
        place (they are views of this step's fresh QKV output) and returned."""
        if fused_ops.usable(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
            fused_ops.rotary_(q, k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
