"""bench/common/roofline.py: the floors every benchmark percentage is measured against (docs/benchmarks.md).

The expected figures are worked out from the shipped config.json files by hand: bytes of K/V per
token, parameters of the projections and experts, and what `--quantization fp8` changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.common.roofline import ModelShape, roofline_seconds
from bench.offline import EXPECTED_TOKENS, workload

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = ROOT / "models" / "configs"
BW, FLOPS = 3.0e12, 790e12


@pytest.fixture(scope="module")
def lens() -> tuple[list[int], list[int]]:
    prompts, outputs = workload()
    assert (sum(map(len, prompts)), sum(outputs)) == EXPECTED_TOKENS
    return [len(p) for p in prompts], outputs


def test_qwen3_0_6b_floor_as_documented(lens) -> None:  # noqa: ANN001
    shape = ModelShape.from_config(CONFIGS / "Qwen3-0.6B")
    assert shape.kv_bytes_per_token == 28 * 2 * 8 * 128 * 2  # 114,688 B
    parts = roofline_seconds(shape, *lens, BW, FLOPS)
    # docs/benchmarks.md: KV 4.62 s + weights 0.41 s + prefill 0.22 s = 5.24 s at 3.0 TB/s
    assert parts["kv_s"] == pytest.approx(4.62, abs=0.01)
    assert parts["weights_s"] == pytest.approx(0.41, abs=0.01)
    assert parts["prefill_s"] == pytest.approx(0.22, abs=0.01)
    fp8_kv = ModelShape.from_config(CONFIGS / "Qwen3-0.6B", kv_dtype_bytes=1)
    assert roofline_seconds(fp8_kv, *lens, BW, FLOPS)["kv_s"] == pytest.approx(parts["kv_s"] / 2)


def test_fp8_weights_count_projections_at_one_byte_and_twice_the_prefill_rate(lens) -> None:  # noqa: ANN001
    bf16 = ModelShape.from_config(CONFIGS / "Qwen3-8B")
    fp8 = ModelShape.from_config(CONFIGS / "Qwen3-8B", fp8_weights=True)
    h, layers, inter, hd = 4096, 36, 12288, 128
    projections = layers * (h * hd * (32 + 2 * 8) + 32 * hd * h + 3 * h * inter)
    assert bf16.weight_bytes - fp8.weight_bytes == projections  # 2 bytes -> 1 each
    assert fp8.fp8_param_share == pytest.approx(projections / bf16.active_params)
    assert 0.8 < fp8.fp8_param_share < 0.9  # embeddings + untied LM head stay bf16
    pre_bf16 = roofline_seconds(bf16, *lens, BW, FLOPS)["prefill_s"]
    pre_fp8 = roofline_seconds(fp8, *lens, BW, FLOPS)["prefill_s"]
    assert pre_fp8 == pytest.approx(pre_bf16 * (1 - fp8.fp8_param_share / 2))


def test_fp8_moe_experts_at_one_byte_router_unchanged() -> None:
    bf16 = ModelShape.from_config(CONFIGS / "Qwen3-30B-A3B")
    fp8 = ModelShape.from_config(CONFIGS / "Qwen3-30B-A3B", fp8_weights=True)
    h, layers, inter, k, e, hd = 2048, 48, 768, 8, 128, 128
    assert bf16.expert_bytes == 2 * fp8.expert_bytes == layers * 3 * h * inter * 2
    attn = h * hd * (32 + 2 * 4) + 32 * hd * h
    # per token: attention and the k routed experts drop to one byte; the router stays
    assert bf16.weight_bytes - fp8.weight_bytes == layers * (attn + 3 * h * inter * k)
    # batch 256 touches all 128 experts: every expert once, at one byte each
    assert bf16.step_weight_bytes(256) == pytest.approx(
        bf16.weight_bytes + (e * (1 - (1 - k / e) ** 256) - k) * bf16.expert_bytes)
    saved = bf16.step_weight_bytes(256) - fp8.step_weight_bytes(256)
    assert saved == pytest.approx(layers * attn + e * layers * 3 * h * inter, rel=1e-3)


def test_tensor_parallel_halves_a_rank_share() -> None:
    one = ModelShape.from_config(CONFIGS / "Qwen3-8B")
    two = ModelShape.from_config(CONFIGS / "Qwen3-8B", tp_size=2)
    assert two.weight_bytes == one.weight_bytes // 2
    assert two.kv_bytes_per_token == one.kv_bytes_per_token // 2


def _shape(tmp_path: Path, cfg: dict) -> ModelShape:
    import json

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return ModelShape.from_config(tmp_path)


GPT_OSS_20B = dict(hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
                   num_key_value_heads=8, head_dim=64, vocab_size=201088, intermediate_size=2880,
                   num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                   layer_types=["sliding_attention", "full_attention"] * 12)


def test_sliding_window_layers_read_at_most_their_window(tmp_path: Path) -> None:
    shape = _shape(tmp_path, GPT_OSS_20B)
    per_layer = 2 * 8 * 64 * 2
    assert (shape.window_layers, shape.window, shape.kv_layer_bytes) == (12, 128, per_layer)
    assert shape.kv_read_bytes(100) == 24 * 100 * per_layer  # inside the window: every layer
    assert shape.kv_read_bytes(1000) == (12 * 1000 + 12 * 128) * per_layer
    # experts: 32 of 3 x 2880 x 2880 a layer, 4 active; the router 2880 x 32
    assert shape.expert_bytes == 24 * 3 * 2880 * 2880 * 2
    attn = 2880 * 64 * (64 + 16) + 64 * 64 * 2880
    assert shape.active_params == 24 * (attn + 3 * 2880 * 2880 * 4 + 2880 * 32) + 2 * 201088 * 2880


def test_gemma_pattern_windows_every_layer_but_each_sixth(tmp_path: Path) -> None:
    shape = _shape(tmp_path, {"text_config": dict(
        hidden_size=3840, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
        head_dim=256, vocab_size=262208, intermediate_size=15360, sliding_window=1024,
        sliding_window_pattern=6, tie_word_embeddings=True)})
    assert (shape.window_layers, shape.window) == (40, 1024)


def test_mla_caches_one_latent_a_token_and_layer(tmp_path: Path) -> None:
    """DeepSeek-V2-Lite: 512 + 64 values a token and layer, against 2 x 16 heads x 192 for
    full K/V; 64 routed experts (6 active) and 2 shared after one dense layer."""
    shape = _shape(tmp_path, dict(
        hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=102400, intermediate_size=10944, moe_intermediate_size=1408,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128))
    assert shape.kv_layer_bytes == (512 + 64) * 2
    assert shape.kv_bytes_per_token == 27 * 576 * 2  # 31,104 B, vs 27 x 2 x 16 x 192 x 2 = 331,776
    assert shape.expert_bytes == 26 * 3 * 2048 * 1408 * 2
    attn = 2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048
    moe_layer = 3 * 2048 * 1408 * (6 + 2) + 2048 * 64
    assert shape.active_params == (27 * attn + 26 * moe_layer + 3 * 2048 * 10944
                                   + 2 * 102400 * 2048)
