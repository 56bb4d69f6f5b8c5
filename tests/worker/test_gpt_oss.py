"""gpt-oss pieces against HF transformers: the clamped SwiGLU experts past their limit, the MoE
block (router bias, top-k-then-softmax, interleaved gate/up, expert biases) loaded from HF's
tensors, and the public gpt-oss-20b config. The whole model's parity (logits, greedy, chunks)
runs in test_models.py, TP=2 in test_tp.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from minisgl_worker.kernels.clamped_swiglu import ClampedSwiGLU
from minisgl_worker.kernels.fused_moe import moe_reference
from minisgl_worker.layers.gpt_oss_moe import GptOssMoeBlock
from minisgl_worker.model_config import ModelConfig
from minisgl_worker.models.gpt_oss import GptOssForCausalLM

ROOT = Path(__file__).resolve().parents[2]
H, INTER, E, K = 32, 16, 8, 4


def _hf_mlp(alpha: float, limit: float, scale: float, seed: int = 0):  # noqa: ANN202
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = GptOssConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E,
                       num_experts_per_tok=K, swiglu_alpha=alpha, swiglu_limit=limit)
    mlp = GptOssMLP(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in mlp.named_parameters():
            p.copy_(scale * torch.randn(p.shape, generator=gen))
    return mlp


def _ours(mlp, alpha: float, limit: float) -> GptOssMoeBlock:  # noqa: ANN001
    block = GptOssMoeBlock(H, INTER, E, K, ClampedSwiGLU(alpha, limit)).eval()
    names = {"router.weight": block.gate.weight, "router.bias": block.gate.bias,
             "experts.gate_up_proj": block.w13, "experts.gate_up_proj_bias": block.w13_bias,
             "experts.down_proj": block.w2, "experts.down_proj_bias": block.w2_bias}
    for name, src in mlp.state_dict().items():
        param = names[name]
        param.weight_loader(param, src, None)
    return block


def test_clamped_swiglu_matches_hf_gate() -> None:
    """HF's _apply_gate on interleaved [gate, up] pairs, the values spanning well past +-limit."""
    mlp = _hf_mlp(alpha=1.5, limit=3.0, scale=0.1)
    gate_up = torch.linspace(-12.0, 12.0, 2 * 241).reshape(1, -1)[:, torch.randperm(482)]
    ref = mlp.experts._apply_gate(gate_up)
    ours = ClampedSwiGLU(1.5, 3.0)(gate_up[..., 0::2], gate_up[..., 1::2])
    torch.testing.assert_close(ours, ref)
    unclamped = ClampedSwiGLU(1.5, 1e9)(gate_up[..., 0::2], gate_up[..., 1::2])
    assert (unclamped - ref).abs().max() > 1.0  # the limit really bit


@pytest.mark.parametrize("alpha, limit", [(1.702, 7.0), (1.25, 2.0)])
def test_moe_block_matches_hf_past_the_limit(alpha: float, limit: float) -> None:
    """Weights large enough that many gate/up values exceed the limit: HF's GptOssMLP and our
    block loaded from its tensors agree, and ignoring the clamp would not."""
    mlp = _hf_mlp(alpha, limit, scale=0.2 * limit)
    block = _ours(mlp, alpha, limit)
    x = torch.randn(23, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = mlp(x.view(1, 23, H))[0][0]
        ours = block(x)
        # the experts' pre-activation values: a good share beyond the limit
        gate_up = torch.einsum("th,ehn->etn", x, mlp.experts.gate_up_proj)
        gate_up = gate_up + mlp.experts.gate_up_proj_bias[:, None]
    assert (gate_up[..., 0::2] > limit).float().mean() > 0.1
    assert (gate_up[..., 1::2].abs() > limit).float().mean() > 0.1
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    weights, ids = block.route_logits(block.gate(x))
    loose = moe_reference(x, block.w13, block.w2, ids, weights, w13_bias=block.w13_bias,
                          w2_bias=block.w2_bias, activation=ClampedSwiGLU(alpha, 1e9))
    assert (loose - ref).abs().max() > 1.0


def test_routing_is_top_k_logits_then_softmax() -> None:
    block = GptOssMoeBlock(H, INTER, E, K, ClampedSwiGLU())
    logits = torch.randn(9, E, generator=torch.Generator().manual_seed(2))
    weights, ids = block.route_logits(logits)
    top, ref_ids = torch.topk(logits, K, dim=-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, torch.softmax(top, dim=-1))


def test_gpt_oss_20b_config_loads_with_alternating_windows() -> None:
    cfg = ModelConfig.load(ROOT / "models/configs/gpt-oss-20b")
    assert cfg.architecture == "GptOssForCausalLM"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        2880, 24, 64, 8, 64)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (32, 4, 2880)
    assert cfg.vocab_size == 201088 and cfg.max_position_embeddings == 131072
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling is not None
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 32.0
    assert cfg.rope_scaling["truncate"] is False
    assert "quantization_config" not in cfg.raw  # the bf16 layout
    layers = GptOssForCausalLM.attention_layers(cfg)
    assert [spec.window for spec in layers] == [128, None] * 12
    assert all(spec.sinks for spec in layers)


def test_missing_layer_types_default_to_hfs_alternation() -> None:
    import json

    d = json.loads((ROOT / "models/configs/gpt-oss-20b/config.json").read_text())
    del d["layer_types"]
    layers = GptOssForCausalLM.attention_layers(ModelConfig.from_dict(d))
    assert [spec.window for spec in layers] == [128, None] * 12


def test_gpt_oss_20b_builds_with_its_shapes() -> None:
    from minisgl_worker.loader import build_model

    cfg = ModelConfig.load(ROOT / "models/configs/gpt-oss-20b")
    model = build_model(cfg, 4096, torch.device("meta"), torch.bfloat16)
    params = dict(model.named_parameters())
    layer = "model.layers.0."
    assert params[layer + "mlp.w13"].shape == (32, 2 * 2880, 2880)
    assert params[layer + "mlp.w13_bias"].shape == (32, 2 * 2880)
    assert params[layer + "mlp.w2"].shape == (32, 2880, 2880)
    assert params[layer + "mlp.gate.bias"].shape == (32,)
    assert params[layer + "self_attn.sinks"].shape == (64,)
    assert params[layer + "self_attn.o_proj.bias"].shape == (2880,)
    assert params[layer + "self_attn.qkv_proj.bias"].shape == ((64 + 2 * 8) * 64,)


def test_mxfp4_checkpoints_parse() -> None:
    """OpenAI's MXFP4 checkpoints load (tests/worker/test_mxfp4.py); other settings refuse."""
    import json

    d = json.loads((ROOT / "models/configs/gpt-oss-20b/config.json").read_text())
    d["quantization_config"] = {"quant_method": "mxfp4"}
    quant = ModelConfig.from_dict(d).quant
    assert quant is not None and quant.scheme == "mxfp4"


def test_gpt_oss_20b_yarn_matches_hf() -> None:
    """The real config's YaRN (truncate false): frequencies and attention factor as HF's."""
    import json

    from minisgl_worker.layers.rotary import rope_parameters
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = json.loads((ROOT / "models/configs/gpt-oss-20b/config.json").read_text())
    cfg = ModelConfig.from_dict(d)
    hf_cfg = GptOssConfig(**{k: v for k, v in d.items() if k not in ("architectures",)})
    ref, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    ours, factor = rope_parameters(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                   cfg.max_position_embeddings, 8192)
    torch.testing.assert_close(ours, ref.float())
    assert factor == pytest.approx(float(ref_factor)) and factor > 1.3
