"""Tiny random-weight HF checkpoints of every supported architecture (hidden 64, 2 layers)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3")
# Gemma 3: two local (window 8, shorter than the tests' long prompts) layers and a global one,
# each kind with its own RoPE (the global one linearly scaled), query_pre_attn_scalar unlike
# head_dim, capped output logits.
GEMMA3 = dict(COMMON, num_hidden_layers=3, head_dim=16, sliding_window=8,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
              rope_theta=1_000_000.0, rope_local_base_freq=100.0,
              rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=24,
              final_logit_softcapping=6.0)


def hf_config(arch: str):  # noqa: ANN201 - a transformers config
    import transformers as tf

    if arch == "llama":  # Llama 3.1 style frequency scaling, visible at these head sizes
        return tf.LlamaConfig(**COMMON, rope_theta=10000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "mistral":
        return tf.MistralConfig(**COMMON, head_dim=16, sliding_window=None)
    if arch == "qwen2":
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=False)
    if arch == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=32, num_experts=8,
                                 num_experts_per_tok=2, norm_topk_prob=True,
                                 decoder_sparse_step=1, mlp_only_layers=[1])
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**GEMMA3)
    raise ValueError(arch)


def build_hf_model(arch: str, seed: int = 0):  # noqa: ANN201 - a transformers model
    """Every weight random (biases and norm scales too), large enough that logits are peaked and
    greedy choices are far from ties."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.15 * noise)
    return model.eval()


def save_tiny(arch: str, path: Path, seed: int = 0, max_shard_size: str | None = None) -> Path:
    model = build_hf_model(arch, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path
