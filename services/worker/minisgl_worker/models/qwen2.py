"""Qwen2 / Qwen2.5: the Llama layout with a bias on the q, k and v projections."""

from __future__ import annotations

from .decoder import CausalLM


class Qwen2ForCausalLM(CausalLM):
    qkv_bias = True
    qk_norm = False
