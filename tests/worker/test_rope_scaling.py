"""RoPE scaling (linear, dynamic NTK, YaRN, Llama 3) against HF transformers: the frequencies
and attention factor of each kind, and a model's logits on a prompt longer than the original
context; a kind or field the engine cannot honour stops start-up naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from minisgl_core.step import ReqPlan, StepPlan
from minisgl_worker.engine import Engine, EngineConfig
from minisgl_worker.layers.rotary import rope_parameters
from minisgl_worker.model_config import ModelConfig

from .tiny_models import COMMON, VOCAB

ORIGINAL = 16  # the tiny models' "trained" context: prompts below run past it
LONG_PROMPT = [(13 * i + 7) % VOCAB for i in range(40)]

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
             "beta_fast": 32.0, "beta_slow": 1.0},
    # gpt-oss writes truncate: false; DeepSeek writes mscale / mscale_all_dim
    "yarn-untruncated": {"rope_type": "yarn", "factor": 8.0, "truncate": False,
                         "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale-1": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                      "original_max_position_embeddings": ORIGINAL},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL},
}


def _hf_config(kind: str, max_positions: int):  # noqa: ANN202 - a transformers config
    import transformers as tf

    return tf.LlamaConfig(**{**COMMON, "max_position_embeddings": max_positions},
                          rope_theta=10000.0, rope_scaling=dict(SCALINGS[kind]))


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_frequencies_and_attention_factor_match_hf(kind: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    trained = ORIGINAL if kind == "dynamic" else 256
    cfg = _hf_config(kind, trained)
    rope_type = SCALINGS[kind]["rope_type"]
    served = len(LONG_PROMPT)
    kwargs = {"seq_len": served} if rope_type == "dynamic" else {}
    ref, ref_factor = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", **kwargs)
    head_dim = COMMON["hidden_size"] // COMMON["num_attention_heads"]
    ours, factor = rope_parameters(head_dim, 10000.0, SCALINGS[kind], trained, served)
    plain, _ = rope_parameters(head_dim, 10000.0, None)
    torch.testing.assert_close(ours, ref.float())
    assert factor == pytest.approx(float(ref_factor))
    assert not torch.allclose(ours, plain)  # the scaling really changes something


def test_dynamic_ntk_is_plain_within_the_trained_context() -> None:
    ours, _ = rope_parameters(16, 10000.0, SCALINGS["dynamic"], 256, 128)
    plain, _ = rope_parameters(16, 10000.0, None)
    torch.testing.assert_close(ours, plain)


def _save(kind: str, path: Path) -> tuple[Path, object]:
    import transformers as tf

    trained = ORIGINAL if kind == "dynamic" else 256
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(_hf_config(kind, trained)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn-mscale", "yarn-untruncated"])
def test_logits_past_the_original_context_match_hf(kind: str, tmp_path: Path) -> None:
    """A 40-token prompt (the original context is 16) in two chunks, against HF's logits over
    the whole prompt. Dynamic NTK is fixed at the served context length (here the prompt's,
    which is what HF computes for this prompt)."""
    path, hf = _save(kind, tmp_path / kind)
    with torch.no_grad():
        ref = hf(torch.tensor([LONG_PROMPT])).logits[0].float()  # type: ignore[operator]
    engine = Engine(EngineConfig(model_path=str(path), page_size=4, num_pages=32, max_slots=2,
                                 max_model_len=len(LONG_PROMPT)))
    pages = list(range(len(LONG_PROMPT) // 4))
    for step, (lo, hi) in enumerate([(0, 24), (24, 40)]):
        req = ReqPlan(rid=0, slot=0, cache_len=lo, input_ids=LONG_PROMPT[lo:hi],
                      new_pages=pages if step == 0 else [], sample=False)
        ours = engine.forward_logits(StepPlan(step, [req]))
        torch.testing.assert_close(ours, ref[lo:hi], atol=2e-4, rtol=1e-4)
    engine.close()


@pytest.mark.parametrize(("scaling", "named"), [
    ({"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0], "long_factor": [2.0]},
     "'longrope'"),
    ({"rope_type": "su", "factor": 2.0}, "'su'"),
])
def test_unknown_rope_scaling_is_refused_naming_it(scaling: dict, named: str,
                                                   tmp_path: Path) -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 4, "vocab_size": 32, "rope_scaling": scaling}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=named) as err:
        ModelConfig.load(tmp_path)
    assert "\n" not in str(err.value)


def test_partial_rotary_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope_parameters(16, 10000.0, {"rope_type": "linear", "factor": 2.0,
                                      "partial_rotary_factor": 0.5})
