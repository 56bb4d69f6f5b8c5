"""DeepSeek-V2 / V3 beyond the parity tests of test_models.py / test_tp.py: what the compressed
KV cache holds, the piecewise plumbing over it, the MTP layers a checkpoint may carry, the
backends' refusal, config refusals, and the public DeepSeek-V2-Lite config."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from minisgl_core.step import ReqPlan, StepPlan
from minisgl_worker.attention import (
    AttentionConfig,
    LayerAttention,
    choose_names,
    refusal,
)
from minisgl_worker.attention.base import AttentionBackend
from minisgl_worker.attention.kv_pool import KVLayout, KVPool
from minisgl_worker.attention.torch_backend import TorchBackend
from minisgl_worker.config import EngineConfig
from minisgl_worker.engine import Engine, startup
from minisgl_worker.engine.piecewise_graph import PiecewiseGraphs
from minisgl_worker.loader import build_model
from minisgl_worker.model_config import ModelConfig
from minisgl_worker.models import model_class
from safetensors.torch import save_file

from .driver import run_requests
from .test_models import PROMPTS
from .tiny_models import DEEPSEEK, build_hf_model

PS = 4
CPU = torch.device("cpu")
V2_LITE = Path(__file__).resolve().parents[2] / "models" / "configs" / "DeepSeek-V2-Lite"
LATENT, ROPE = DEEPSEEK["kv_lora_rank"], DEEPSEEK["qk_rope_head_dim"]


def _engine(path: object, **kw: object) -> Engine:
    cfg = dict(model_path=str(path), page_size=PS, num_pages=32, max_slots=4)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))  # type: ignore[arg-type]


def _prefill(engine: Engine, prompt: list[int]) -> torch.Tensor:
    pages = list(range(-(-len(prompt) // PS)))
    return engine.forward_logits(StepPlan(0, [ReqPlan(rid=0, slot=0, cache_len=0,
                                                      input_ids=prompt, new_pages=pages,
                                                      sample=False)]))


def test_the_pool_holds_the_latent_and_the_rotary_key_only(tiny_model) -> None:  # noqa: ANN001
    """Per token and layer: kv_lora_rank + qk_rope_head_dim values, V a view of K's latent,
    and they are HF's normed latent c_kv and rotated k_pe (in the de-interleaved order)."""
    engine = _engine(tiny_model("deepseek_v3"))
    pool, layers, width = engine.pool, 2, LATENT + ROPE
    assert pool.mla and pool.head_dim == width and pool.num_kv_heads == 1
    for k, v in zip(pool.k, pool.v, strict=True):
        assert k.shape == (pool.num_pages + 1, PS, 1, width)
        assert v.shape[-1] == LATENT and v.data_ptr() == k.data_ptr()  # no storage of its own
    per_token = layers * width * 4  # fp32
    assert pool.memory_bytes() == (pool.num_pages + 1) * PS * per_token
    assert KVPool.bytes_per_page(layers, PS, 1, width, torch.float32, LATENT) == PS * per_token
    assert KVLayout(1, width, LATENT).bytes_per_token(layers, torch.float32, tp_size=2) \
        == per_token  # the latent is on every rank
    mc = engine.model.cfg
    assert startup.size_kv_cache(EngineConfig(model_path="x", mem_fraction=0.5), mc, 1, PS,
                                 torch.float32, CPU, memory=(2**21, 2**21)) \
        == 2**20 // (PS * per_token)

    prompt = PROMPTS[0]
    _prefill(engine, prompt)
    hf = build_hf_model("deepseek_v3")
    attn = hf.model.layers[0].self_attn
    ids = torch.tensor([prompt])
    with torch.no_grad():
        x = hf.model.layers[0].input_layernorm(hf.model.embed_tokens(ids))
        latent, k_rot = attn.kv_a_proj_with_mqa(x).split([LATENT, ROPE], dim=-1)
        latent = attn.kv_a_layernorm(latent)[0]
        cos, sin = hf.model.rotary_emb(x, torch.arange(len(prompt))[None])
        half = ROPE // 2
        k1, k2 = k_rot[0, :, 0::2], k_rot[0, :, 1::2]
        c, s = cos[0, :, :half], sin[0, :, :half]
        k_pe = torch.cat([k1 * c - k2 * s, k2 * c + k1 * s], dim=-1)
    stored = pool.k_flat(0)[: len(prompt), 0]  # pages 0.. in order: slots 0..len-1
    torch.testing.assert_close(stored[:, :LATENT], latent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stored[:, LATENT:], k_pe, atol=1e-5, rtol=1e-5)
    engine.close()


def test_piecewise_plumbing_carries_the_latent_widths(tiny_model) -> None:  # noqa: ANN001
    """The piecewise graphs' static q / k / v / output buffers take MLA's widths (output =
    latent width, not head_dim); run eagerly on the CPU, the tokens are those without."""
    path = tiny_model("deepseek_v2")
    plain = _engine(path, max_model_len=128)
    want = run_requests(plain, PROMPTS, 6, PS, chunk=8, starts=[0, 0, 2])
    engine = _engine(path, max_model_len=128)
    engine.piecewise = PiecewiseGraphs(engine.model, engine.backend, engine.pool,
                                       max_tokens=24, eager=True)
    assert engine.piecewise.out.shape[-1] == LATENT
    assert engine.piecewise.q.shape[-1] == engine.piecewise.k.shape[-1] == LATENT + ROPE
    assert run_requests(engine, PROMPTS, 6, PS, chunk=8, starts=[0, 0, 2]) == want
    assert engine.piecewise.replays > 0
    plain.close()
    engine.close()


def test_mtp_layers_of_a_checkpoint_are_skipped(tiny_model, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    """A V3 checkpoint with a next-token-prediction layer (index num_hidden_layers, its own
    embedding, norms, projection and head) loads without it, says so, and computes as before."""
    src = tiny_model("deepseek_v3")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    h, n = config["hidden_size"], "model.layers.2."
    mtp = {f"{n}{k}": torch.randn(*shape) for k, shape in {
        "embed_tokens.weight": (config["vocab_size"], h), "enorm.weight": (h,),
        "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
        "shared_head.norm.weight": (h,), "shared_head.head.weight": (config["vocab_size"], h),
        "self_attn.q_a_proj.weight": (24, h), "self_attn.kv_b_proj.weight": (4 * 32, LATENT),
        "mlp.experts.0.gate_proj.weight": (32, h), "mlp.gate.e_score_correction_bias": (8,),
    }.items()}
    save_file(mtp, str(tmp_path / "model-mtp.safetensors"))
    with caplog.at_level(logging.INFO, logger="minisgl_worker.loader"):
        engine = _engine(tmp_path)
    assert any("skipped checkpoint layers [2]" in r.getMessage() for r in caplog.records)
    base = _engine(src)
    torch.testing.assert_close(_prefill(engine, PROMPTS[0]), _prefill(base, PROMPTS[0]))
    engine.close()
    base.close()


def test_which_backends_serve_latent_attention() -> None:
    """torch and triton (kernels/mla_attention.py) compute it; FlashInfer (the default refusal)
    does not, nor does triton combined with windows or sinks; auto on a CPU takes torch."""
    from minisgl_worker.attention.triton_backend import TritonBackend

    layers = (LayerAttention(value_dim=512),) * 2
    cfg = AttentionConfig(16, 1, 576, 0.1, 16, 2, 4, 64, torch.bfloat16, CPU, layers=layers)
    assert cfg.v_head_dim == 512 and AttentionConfig(4, 2, 16, 0.1, 4, 2, 4, 16,
                                                     torch.float32, CPU).v_head_dim == 16
    assert refusal(TorchBackend, layers) is None
    assert refusal(TritonBackend, layers) is None
    why = refusal(AttentionBackend, layers)  # the default: what FlashInfer inherits
    assert why is not None and "multi-head latent attention" in why
    why = refusal(TritonBackend, (LayerAttention(value_dim=512, sinks=True),))
    assert why is not None and "latent attention with windows or sinks" in why
    assert choose_names("auto", cfg) == ("torch", "torch")


def _v2_lite(**changes: object) -> ModelConfig:
    d = json.loads((V2_LITE / "config.json").read_text())
    d.update(changes)
    return ModelConfig.from_dict(d)


@pytest.mark.parametrize("changes, named", [
    ({"norm_topk_prob": True}, "norm_topk_prob"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "scoring_func": "softmax",
      "topk_method": "noaux_tc"}, "scoring_func='softmax'"),
    ({"n_group": 3, "topk_method": "group_limited_greedy"}, "n_group=3"),
])
def test_unimplemented_config_fields_stop_start_up(changes: dict, named: str) -> None:
    mc = _v2_lite(**changes)
    with pytest.raises(ValueError, match=named) as err:
        model_class(mc.architecture).kv_layout(mc)
    assert "\n" not in str(err.value)


def test_deepseek_v2_lite_config_loads() -> None:
    """The public config: accepted, the compressed cache's bytes, the scale and YaRN as HF
    computes them, and the 15.7B parameters of the published model."""
    from minisgl_worker.layers.rotary import rope_parameters
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import yarn_apply_mscale

    mc = ModelConfig.load(V2_LITE)
    cls = model_class(mc.architecture)
    assert mc.architecture == "DeepseekV2ForCausalLM" and mc.num_layers == 27
    layout = cls.kv_layout(mc)
    assert layout == KVLayout(1, 512 + 64, v_dim=512)
    bf16 = torch.bfloat16
    assert layout.bytes_per_token(27, bf16) == 27 * 576 * 2  # 31,104 bytes
    full = 27 * 16 * (128 + 64 + 128) * 2  # every head's K (nope + rope) and V: 276,480 bytes
    assert full / layout.bytes_per_token(27, bf16) > 8.8
    assert all(spec.value_dim == 512 for spec in cls.attention_layers(mc))

    hf = AutoConfig.from_pretrained(V2_LITE)
    assert cls.attention_scale(mc) == pytest.approx(
        yarn_apply_mscale(hf.rope_parameters, hf.qk_head_dim ** -0.5), rel=1e-12)
    inv_hf, factor_hf = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    inv, factor = rope_parameters(64, mc.rope_theta, mc.rope_scaling,
                                  mc.max_position_embeddings)
    torch.testing.assert_close(inv, inv_hf.float())
    assert factor == pytest.approx(factor_hf)

    model = build_model(mc, 4096, torch.device("meta"), bf16)
    params = sum(p.numel() for p in model.parameters())
    assert 15.6e9 < params < 15.8e9, params
