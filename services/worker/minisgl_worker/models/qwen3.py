"""Qwen3 (dense): no QKV bias; RMSNorm over each q and k head before the rotary embedding."""

from __future__ import annotations

from .decoder import CausalLM


class Qwen3ForCausalLM(CausalLM):
    qkv_bias = False
    qk_norm = True
