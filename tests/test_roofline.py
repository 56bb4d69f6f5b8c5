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
