"""Llama 2/3.x (rope scaling comes from config.json) and Mistral, which shares the architecture:
no QKV bias, no q/k norm, SwiGLU MLP; Mistral v0.1's sliding window (config `sliding_window`)
windows every layer."""

from __future__ import annotations

from .decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    qkv_bias = False
    qk_norm = False


class MistralForCausalLM(LlamaForCausalLM):
    pass
