"""Llama 2/3.x (Llama-3 rope scaling comes from config.json) and Mistral, which shares the
architecture: no QKV bias, no q/k norm, SwiGLU MLP. Mistral's sliding window is not implemented;
the engine caps the context at the window instead (where it would change nothing)."""

from __future__ import annotations

from .decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    qkv_bias = False
    qk_norm = False


class MistralForCausalLM(LlamaForCausalLM):
    pass
