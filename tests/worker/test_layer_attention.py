"""Per-layer attention features (attention/base.py `LayerAttention`): a sliding window against HF
transformers (Mistral with `sliding_window` set), the torch backend's soft-cap and sinks against
a dense reference, and the start-up refusal of a backend without a kernel for a feature."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from minisgl_core.step import ReqPlan, StepPlan
from minisgl_worker.attention import (
    PLAIN,
    AttentionConfig,
    BackendUnavailable,
    LayerAttention,
    choose_names,
    refusal,
)
from minisgl_worker.attention.kv_pool import KVPool
from minisgl_worker.attention.torch_backend import TorchBackend
from minisgl_worker.attention.triton_backend import TritonBackend
from minisgl_worker.engine import Engine, EngineConfig
from minisgl_worker.engine.batch import PlanBuilder

from .tiny_models import VOCAB, windowed_mistral

WINDOW = 6
SEQ = [(7 * i + 3) % VOCAB for i in range(22)]


def _windowed_mistral(path: Path):  # noqa: ANN202 - a transformers model
    model = windowed_mistral(WINDOW, seed=2)
    model.save_pretrained(path, safe_serialization=True)
    return model


def test_sliding_window_matches_hf_over_chunks_and_decode(tmp_path: Path) -> None:
    """A 22-token sequence (window 6) as chunks of 5 and 7 and then one token a step: every
    position's logits against HF's, which masks keys more than 6 positions back."""
    hf = _windowed_mistral(tmp_path)
    with torch.no_grad():
        ref = hf(torch.tensor([SEQ])).logits[0].float()
        hf.config.sliding_window = None
        full = hf(torch.tensor([SEQ])).logits[0].float()
    # the window changes every position past it, and nothing before
    torch.testing.assert_close(full[:WINDOW], ref[:WINDOW])
    assert (full[WINDOW:] - ref[WINDOW:]).abs().amax(-1).min() > 1e-2
    engine = Engine(EngineConfig(model_path=str(tmp_path), page_size=4, num_pages=16,
                                 max_slots=2))
    pages = list(range(-(-len(SEQ) // 4)))
    chunks = [(0, 5), (5, 12)] + [(i, i + 1) for i in range(12, len(SEQ))]
    for step, (lo, hi) in enumerate(chunks):
        # window 6 < max_model_len: the window pool, whose pages come with the main ones
        req = ReqPlan(rid=0, slot=0, cache_len=lo, input_ids=SEQ[lo:hi],
                      new_pages=pages if step == 0 else [],
                      new_window_pages=pages if step == 0 else [], sample=False)
        ours = engine.forward_logits(StepPlan(step, [req]))
        torch.testing.assert_close(ours, ref[lo:hi], atol=2e-4, rtol=1e-4)
    engine.close()


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               spec: LayerAttention, sinks: torch.Tensor | None) -> torch.Tensor:
    """One request, no cache: q, k, v [T, H, D] (as many kv heads as query heads)."""
    t = q.shape[0]
    logits = torch.einsum("qhd,khd->hqk", q, k) * scale
    if spec.softcap:
        logits = spec.softcap * torch.tanh(logits / spec.softcap)
    i = torch.arange(t)
    dist = i[:, None] - i[None, :]
    keep = (dist >= 0) & (dist < (spec.window or t + 1))
    logits = logits.masked_fill(~keep, float("-inf"))
    weights = torch.exp(logits - logits.amax(-1, keepdim=True))
    denom = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sinks.view(-1, 1, 1) - logits.amax(-1, keepdim=True))
    return torch.einsum("hqk,khd->qhd", weights / denom, v)


@pytest.mark.parametrize("spec", [LayerAttention(softcap=5.0), LayerAttention(sinks=True),
                                  LayerAttention(window=3, sinks=True, softcap=2.0)])
def test_torch_backend_features_match_a_dense_reference(spec: LayerAttention) -> None:
    torch.manual_seed(0)
    t, h, d, ps = 9, 2, 8, 4
    cfg = AttentionConfig(h, h, d, 0.7, ps, 2, 4, 16, torch.float32, torch.device("cpu"),
                          layers=(spec,))
    pool = KVPool(1, 4, ps, h, d, torch.float32, torch.device("cpu"), 2, 4)
    backend = TorchBackend(cfg, pool)
    builder = PlanBuilder(2, 4, 4, ps, 16, VOCAB, torch.device("cpu"))
    step = builder.build(StepPlan(0, [ReqPlan(rid=0, slot=0, cache_len=0, input_ids=[1] * t,
                                               new_pages=[0, 1, 2], sample=False)]))
    q, k, v = (torch.randn(t, h, d) * 2 for _ in range(3))
    sinks = torch.randn(h) if spec.sinks else None
    backend.prepare(step[0].batch)
    out = backend.forward(q, k, v, 0, sinks=sinks)
    torch.testing.assert_close(out, _reference(q, k, v, 0.7, spec, sinks), atol=1e-5,
                               rtol=1e-5)


def test_a_backend_without_the_kernel_is_refused_naming_the_feature() -> None:
    layers = (PLAIN, LayerAttention(window=128, sinks=True), LayerAttention(softcap=30.0))
    assert refusal(TorchBackend, layers) is None
    assert refusal(TritonBackend, layers[:2]) is None
    why = refusal(TritonBackend, layers)
    assert why is not None and "layer 2" in why and "soft-cap 30.0" in why
    cfg = AttentionConfig(4, 2, 16, 0.25, 4, 2, 4, 16, torch.float32, torch.device("cpu"),
                          layers=layers)
    assert choose_names("auto", cfg) == ("torch", "torch")  # auto finds one that can
    assert choose_names("torch", cfg) == ("torch", "torch")


def test_explicit_backend_that_cannot_serve_the_model_fails_at_start_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any weight loads: a model whose layers need a soft-cap, on --attention-backend
    triton (no soft-cap kernel), stops with one line naming the layer and the feature."""
    pytest.importorskip("triton")
    from minisgl_worker.engine import startup
    from minisgl_worker.models.llama import MistralForCausalLM

    _windowed_mistral(tmp_path)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(MistralForCausalLM, "attention_layers",
                        classmethod(lambda cls, cfg: (PLAIN, LayerAttention(softcap=50.0))))

    def no_loading(*args: object, **kw: object) -> None:
        raise AssertionError("weights loaded before the backend check")

    monkeypatch.setattr(startup, "load_model", no_loading)
    with pytest.raises(BackendUnavailable, match="layer 1: no kernel for logit soft-cap 50.0"
                       ) as err:
        Engine(EngineConfig(model_path=str(tmp_path), page_size=4, num_pages=16, max_slots=2,
                            attention_backend="triton"))
    assert "\n" not in str(err.value)


def test_qwen2_window_starts_at_max_window_layers_as_in_transformers() -> None:
    """A Qwen2-style config with use_sliding_window and no layer_types: the layers below
    max_window_layers attend fully, the rest through the window (transformers' derivation)."""
    import transformers as tf
    from minisgl_worker.model_config import ModelConfig

    d = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "vocab_size": 32, "use_sliding_window": True,
         "sliding_window": 8, "max_window_layers": 1}
    hf = tf.Qwen2Config(**{k: v for k, v in d.items() if k != "architectures"})
    ours = ModelConfig.from_dict(d)
    assert [ours.layer_window(i) for i in range(4)] == [
        8 if t == "sliding_attention" else None for t in hf.layer_types] == [None, 8, 8, 8]
    assert ModelConfig.from_dict({**d, "use_sliding_window": False}).layer_window(3) is None
