"""Gemma 3 beyond the shared parity tests (test_models.py, test_tp.py run the tiny text model):
the multimodal checkpoint's language model (both tensor layouts), the (1 + w) norm in bf16, the
real 12B config, and the refusals of what is not computed."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from minisgl_core.step import ReqPlan, StepPlan
from minisgl_worker.engine import Engine, EngineConfig
from minisgl_worker.model_config import ModelConfig
from safetensors.torch import load_file, save_file

from .driver import with_window_pages
from .test_models import PROMPTS
from .tiny_models import GEMMA3

REPO = Path(__file__).resolve().parents[2]
CONFIG_12B = REPO / "models" / "configs" / "gemma-3-12b-it"
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=32, patch_size=8)


def _randomize(model: Any, seed: int = 0) -> Any:
    """Every weight random, as tiny_models.build_hf_model does."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model.eval()


def _logits(path: Path, prompt: list[int]) -> torch.Tensor:
    engine = Engine(EngineConfig(model_path=str(path), page_size=4, num_pages=64, max_slots=4))
    try:
        pages = list(range(-(-len(prompt) // 4)))
        return engine.forward_logits(with_window_pages(
            engine, StepPlan(0, [ReqPlan(0, 0, 0, prompt, 0, pages)])))
    finally:
        engine.close()


def _check_against(hf: Any, path: Path) -> None:
    for prompt in PROMPTS[:2]:
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([prompt])).logits[0].float()
        assert ref.abs().max() > 1.0
        torch.testing.assert_close(_logits(path, prompt), ref, atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A tiny Gemma3ForConditionalGeneration and its checkpoint (transformers 5 saves it in the
    public checkpoints' layout: language_model.model.*, vision_tower.*, ...). The
    text config is the shared tiny one, without the output soft-cap (refused for this class)."""
    import transformers as tf

    text = dict(GEMMA3, final_logit_softcapping=None)
    cfg = tf.Gemma3Config(text_config=text, vision_config=VISION, mm_tokens_per_image=4)
    torch.manual_seed(0)
    hf = _randomize(tf.Gemma3ForConditionalGeneration(cfg).float())
    path = tmp_path_factory.mktemp("gemma3-mm")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


def _vision_count(tensors: dict[str, torch.Tensor]) -> int:
    return sum(1 for n in tensors if "vision_tower" in n or "multi_modal_projector" in n)


def test_multimodal_checkpoint_serves_its_language_model(multimodal: tuple[Any, Path],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    hf, path = multimodal
    tensors = load_file(str(next(path.glob("*.safetensors"))))
    assert any(n.startswith("language_model.model.") for n in tensors)  # as transformers saves
    skipped = _vision_count(tensors)
    assert skipped > 0
    with caplog.at_level(logging.INFO, logger="minisgl_worker.loader"):
        _check_against(hf, path)
    lines = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert lines and all(line == f"skipped {skipped} checkpoint tensors: the vision tower and "
                         "projector (text-only serving)" for line in lines)


def _relayout(src: Path, dst: Path, rename: Any, extra: dict[str, torch.Tensor] | None = None
              ) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(next(src.glob("*.safetensors"))))
    out = {rename(n): t.contiguous() for n, t in tensors.items()}
    save_file({**out, **(extra or {})}, str(dst / "model.safetensors"))
    return dst


def _new_name(name: str) -> str:
    """The layout of checkpoints saved from transformers 4.52-4.x state dicts."""
    if name.startswith("language_model.model."):
        return "model.language_model." + name[len("language_model.model."):]
    return "model." + name  # vision_tower.*, multi_modal_projector.*


def test_multimodal_checkpoint_in_the_model_language_model_layout(
        multimodal: tuple[Any, Path], tmp_path: Path) -> None:
    hf, path = multimodal
    new = _relayout(path, tmp_path / "new", _new_name,
                    {"lm_head.weight": hf.lm_head.weight.detach().clone()})
    names = load_file(str(new / "model.safetensors"))
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert any(n.startswith("model.vision_tower.") for n in names)
    _check_against(hf, new)


def test_multimodal_checkpoint_with_an_unknown_tensor_is_refused(multimodal: tuple[Any, Path],
                                                                 tmp_path: Path) -> None:
    _, path = multimodal
    name = "language_model.model.layers.0.self_attn.q_proj.weight_scale"
    bad = _relayout(path, tmp_path / "bad", lambda n: n, {name: torch.ones(4)})
    with pytest.raises(ValueError, match="not all loaded") as err:
        _logits(bad, [1, 2, 3])
    assert repr(name) in str(err.value) and "\n" not in str(err.value)


def test_unit_offset_norm_is_gemmas_in_bf16() -> None:
    """fp32 checkpoint weights served in bf16: rounded to bf16, then 1 + w in fp32, the product
    rounded once, bit for bit as transformers' Gemma3RMSNorm."""
    from minisgl_worker.layers.norm import RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gen = torch.Generator().manual_seed(0)
    w = 0.3 * torch.randn(64, generator=gen)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    ref = Gemma3RMSNorm(64, 1e-6)
    ref.weight.data = w.to(torch.bfloat16)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        ours = RMSNorm(64, 1e-6, unit_offset=True)
    finally:
        torch.set_default_dtype(old)
    ours.weight.weight_loader(ours.weight, w)  # type: ignore[attr-defined]
    assert ours.weight.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))


def test_12b_config_is_accepted_and_builds_its_layers() -> None:
    import transformers as tf
    from minisgl_worker.loader import build_model
    from minisgl_worker.models import model_class

    cfg = ModelConfig.load(CONFIG_12B)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (
        "Gemma3ForCausalLM", 3840, 48, 16, 8, 256, 15360, 262208)
    ref = tf.Gemma3TextConfig(**json.loads((CONFIG_12B / "config.json").read_text()))
    assert cfg.layer_types == ref.layer_types
    assert cfg.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    full, local = ref.rope_parameters["full_attention"], ref.rope_parameters["sliding_attention"]
    assert (cfg.rope_theta, cfg.rope_scaling) == (full["rope_theta"], {
        "rope_type": "linear", "factor": 8.0})
    assert cfg.sliding_rope == (local["rope_theta"], None) == (10000.0, None)
    cls = model_class(cfg.architecture)
    layers = cls.attention_layers(cfg)
    assert [s.window for s in layers] == [None if (i + 1) % 6 == 0 else 1024 for i in range(48)]
    assert all(s.softcap is None and not s.sinks for s in layers)
    assert cls.attention_scale(cfg) == 256 ** -0.5
    assert cls.final_logit_softcap(cfg) is None
    model = build_model(cfg, 4096, torch.device("meta"), torch.bfloat16)  # shapes only
    rot = [layer.self_attn.rotary[0] for layer in model.model.layers]
    assert [r is model.rotary for r in rot] == [s.window is None for s in layers]
    assert all(r is model.sliding_rotary for r, s in zip(rot, layers, strict=True) if s.window)


def test_sparse_multimodal_config_takes_gemma3_defaults() -> None:
    """The public multimodal configs write a sparse text_config: what they leave out is
    transformers' Gemma 3 default, not the generic one (head_dim 256, not hidden / heads)."""
    import transformers as tf

    causal = ModelConfig.load(CONFIG_12B)
    sparse = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "eos_token_id": [1, 106], "torch_dtype": "bfloat16",
              "text_config": {"hidden_size": 3840, "intermediate_size": 15360,
                              "model_type": "gemma3_text", "num_attention_heads": 16,
                              "num_hidden_layers": 48, "num_key_value_heads": 8,
                              "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                              "sliding_window": 1024},
              "vision_config": {"model_type": "siglip_vision_model", **VISION}}
    cfg = ModelConfig.from_dict(sparse)
    same = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
            "max_position_embeddings", "tie_word_embeddings", "eos_token_ids", "sliding_window",
            "layer_types", "sliding_rope")
    assert {k: getattr(cfg, k) for k in same} == {k: getattr(causal, k) for k in same}
    assert cfg.architecture == "Gemma3ForConditionalGeneration"
    assert cfg.raw["query_pre_attn_scalar"] == 256
    ref = tf.Gemma3Config(**{k: v for k, v in sparse.items() if k != "architectures"})
    assert cfg.layer_types == ref.text_config.layer_types
    assert cfg.rope_theta == ref.text_config.rope_parameters["full_attention"]["rope_theta"]


@pytest.mark.parametrize(("change", "field"), [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"attention_bias": True}, "attention_bias"),
    ({"sliding_window": None}, "sliding_window"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
])
def test_unimplemented_fields_are_refused(change: dict, field: str) -> None:
    d = json.loads((CONFIG_12B / "config.json").read_text())
    d.update(change)
    with pytest.raises(ValueError, match=field) as err:
        ModelConfig.from_dict(d)
    assert "\n" not in str(err.value)


def test_multimodal_output_softcap_is_refused(multimodal: tuple[Any, Path]) -> None:
    _, path = multimodal
    d = json.loads((path / "config.json").read_text())
    d["text_config"]["final_logit_softcapping"] = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping") as err:
        ModelConfig.from_dict(d)
    assert "\n" not in str(err.value)


def test_fp8_feeds_the_mlp_input_norm_not_the_post_attention_one(tiny_model) -> None:  # noqa: ANN001
    """A sandwich layer's post-attention norm output joins the residual sum: it must stay
    unquantized; the pre-feedforward norm is the one whose only consumer is gate_up."""
    from minisgl_worker.layers.norm import Fp8FeedingRMSNorm
    from minisgl_worker.loader import load_model

    path = tiny_model("gemma3")
    cfg = ModelConfig.load(path)
    model = load_model(path, cfg, "safetensors", 64, torch.device("cpu"), torch.float32,
                       quantization="fp8")
    for layer in model.model.layers:
        assert isinstance(layer.input_layernorm, Fp8FeedingRMSNorm)
        assert isinstance(layer.pre_feedforward_layernorm, Fp8FeedingRMSNorm)
        assert layer.pre_feedforward_layernorm.unit_offset
        for name in ("post_attention_layernorm", "post_feedforward_layernorm"):
            assert not isinstance(getattr(layer, name), Fp8FeedingRMSNorm), name
