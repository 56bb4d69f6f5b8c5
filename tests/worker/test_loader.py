"""Checkpoint loading (sharded, incomplete), the dummy format, and the shipped model configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from minisgl_core.step import ReqPlan, StepPlan
from minisgl_worker.engine import Engine, EngineConfig
from minisgl_worker.loader import build_model
from minisgl_worker.model_config import ModelConfig
from safetensors.torch import load_file, save_file

from .tiny_models import save_tiny

CONFIGS = Path(__file__).resolve().parents[2] / "models" / "configs"
PROMPT = [5, 17, 300, 42, 9, 77, 123]


def _logits(path: Path, **kw: object) -> torch.Tensor:
    engine = Engine(EngineConfig(model_path=str(path), page_size=4, num_pages=16, max_slots=2,
                                 **kw))  # type: ignore[arg-type]
    try:
        return engine.forward_logits(StepPlan(0, [ReqPlan(0, 0, 0, PROMPT, 0, [0, 1])]))
    finally:
        engine.close()


def test_sharded_checkpoint_with_index(tmp_path: Path, tiny_model) -> None:  # noqa: ANN001
    sharded = save_tiny("qwen3_moe", tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert torch.equal(_logits(sharded), _logits(tiny_model("qwen3_moe")))


def test_missing_tensor_is_a_clear_error(tmp_path: Path, tiny_model) -> None:  # noqa: ANN001
    src = tiny_model("qwen2")
    dst = tmp_path / "broken"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match="qkv_proj.bias"):
        _logits(dst)


def test_no_weights_points_at_dummy(tmp_path: Path, tiny_model) -> None:  # noqa: ANN001
    shutil.copy(tiny_model("llama") / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="dummy"):
        _logits(tmp_path)


def test_dummy_weights_are_deterministic(tmp_path: Path) -> None:
    # The shipped Qwen3-0.6B config at full width, one layer and a small vocabulary for speed.
    overrides = {"num_hidden_layers": 1, "vocab_size": 1024}
    path = CONFIGS / "Qwen3-0.6B"
    a = _logits(path, load_format="dummy", hf_overrides=overrides)
    b = _logits(path, load_format="dummy", hf_overrides=overrides)
    c = _logits(path, load_format="dummy", hf_overrides=overrides, dummy_seed=1)
    assert a.shape == (len(PROMPT), 1024) and torch.isfinite(a).all()
    assert torch.equal(a, b) and not torch.equal(a, c)


# Published sizes (total parameters, embeddings included once when tied).
EXPECTED_PARAMS = {
    "Qwen3-0.6B": 0.596e9, "Qwen3-8B": 8.19e9, "Qwen3-14B": 14.77e9, "Qwen3-32B": 32.76e9,
    "Qwen3-30B-A3B": 30.53e9, "Llama-3.1-8B": 8.03e9, "Qwen2.5-7B": 7.62e9,
}


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_shipped_configs_build_real_shapes(name: str) -> None:
    cfg = ModelConfig.load(CONFIGS / name)
    model = build_model(cfg, 4096, torch.device("meta"), torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n / EXPECTED_PARAMS[name] - 1) < 0.01, f"{name}: {n / 1e9:.3f}B parameters"


def test_shipped_config_details() -> None:
    llama = ModelConfig.load(CONFIGS / "Llama-3.1-8B")
    assert llama.rope_scaling is not None and llama.rope_scaling["rope_type"] == "llama3"
    assert llama.rope_theta == 500000.0 and llama.head_dim == 128
    moe = ModelConfig.load(CONFIGS / "Qwen3-30B-A3B")
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    assert moe.norm_topk_prob and all(moe.is_moe_layer(i) for i in range(moe.num_layers))
    small = ModelConfig.load(CONFIGS / "Qwen3-0.6B")
    assert small.tie_word_embeddings and small.head_dim == 128 and small.num_kv_heads == 8
    qwen25 = ModelConfig.load(CONFIGS / "Qwen2.5-7B")
    assert qwen25.sliding_window is None  # use_sliding_window: false


def test_transformers5_config_keys() -> None:
    d = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "vocab_size": 10,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}}
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["factor"] == 8.0  # type: ignore[index]
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
    assert ModelConfig.from_dict(d).rope_scaling is None
