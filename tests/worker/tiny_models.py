"""Tiny random-weight HF checkpoints of every supported architecture (hidden 64, 2 layers)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v2",
         "deepseek_v3", "gemma3")
# gpt-oss: YaRN over an "original" context the test prompts run past (the chunked test's 45
# tokens), a window of 8 on the first layer, and a SwiGLU limit low enough that the tiny
# model's gate/up values cross it (the real 7.0 is seldom reached by these weights).
GPT_OSS = dict(head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=4,
               sliding_window=8, layer_types=["sliding_attention", "full_attention"],
               swiglu_limit=1.5, attention_bias=True, tie_word_embeddings=False,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0,
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                "original_max_position_embeddings": 16})
# DeepSeek's latent attention: small latent and head widths, every head its own KV in HF terms.
DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8,
                num_experts_per_tok=2)
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
    if arch == "gpt_oss":
        return tf.GptOssConfig(**{**COMMON, **GPT_OSS})
    if arch == "deepseek_v2":  # q_proj, softmax routing: top-3 within the best 2 of 4 groups
        return tf.DeepseekV2Config(**{**COMMON, **DEEPSEEK, "num_experts_per_tok": 3},
                                   q_lora_rank=None, n_shared_experts=2,
                                   first_k_dense_replace=0, topk_method="group_limited_greedy",
                                   n_group=4, topk_group=2, routed_scaling_factor=1.5)
    if arch == "deepseek_v3":  # q LoRA, sigmoid + bias, noaux_tc, a dense first layer, YaRN
        return tf.DeepseekV3Config(
            **{**COMMON, **DEEPSEEK}, q_lora_rank=24, n_shared_experts=1, first_k_dense_replace=1,
            n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "mscale": 0.9,
                             "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1})
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**GEMMA3)
    raise ValueError(arch)


def build_hf_model(arch: str, seed: int = 0):  # noqa: ANN201 - a transformers model
    """Every weight random (biases and norm scales too), large enough that logits are peaked and
    greedy choices are far from ties."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
    return randomize(model, seed)


def randomize(model, seed: int):  # noqa: ANN001, ANN201 - a transformers model
    """Every weight of `model` drawn from a generator seeded `seed`: norm scales near 1, the
    rest (biases too) at 0.15 scale, sinks as large as attention logits, DeepSeek-V3's
    correction bias (a buffer) random too; the model in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("sinks"):  # gpt-oss: sink logits as large as the attention's
                p.copy_(2.0 * noise)
            elif name.endswith("e_score_correction_bias"):  # a buffer in HF: set below
                continue
            else:
                p.copy_(0.15 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: picks, never weighs
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return model.eval()


def windowed_mistral(window: int, seed: int):  # noqa: ANN201 - a transformers model
    """A tiny Mistral whose every layer attends through a `window`-token sliding window."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.MistralForCausalLM(tf.MistralConfig(**COMMON, head_dim=16, sliding_window=window))
    return randomize(model, seed)


def save_tiny(arch: str, path: Path, seed: int = 0, max_shard_size: str | None = None) -> Path:
    model = build_hf_model(arch, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path
