"""Gemma 3 through the layers' CUDA paths, the Triton kernels run by the interpreter (no GPU
here): the fused q/k-norm + rotary + KV-store prologue with each layer's own rotary (local and
global) and fp32 (1 + w) norm weights, the fused norms, logits still HF's."""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from minisgl_core.step import ReqPlan, StepPlan  # noqa: E402
from minisgl_worker.engine import Engine, EngineConfig  # noqa: E402
from minisgl_worker.kernels import fused_ops  # noqa: E402

from .driver import with_window_pages  # noqa: E402
from .test_models import PROMPTS, VOCAB  # noqa: E402
from .tiny_models import build_hf_model  # noqa: E402


def test_fused_layers_match_hf_with_a_rotary_per_layer_kind(tiny_model, monkeypatch) -> None:  # noqa: ANN001
    path, hf = tiny_model("gemma3"), build_hf_model("gemma3")
    seq = PROMPTS[0] + [(5 * i + 1) % VOCAB for i in range(3)]
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].float()
    monkeypatch.setattr(fused_ops, "usable", lambda x: True)
    cos_seen: list[int] = []
    real = fused_ops.qk_norm_rope_store_

    def spy(*args: object, **kw: object) -> None:
        cos_seen.append(args[4].data_ptr())  # type: ignore[attr-defined]
        real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(fused_ops, "qk_norm_rope_store_", spy)
    # No window pool: with one the backend stores K/V itself (two page tables) and the fused
    # prologue is off; windows are still masked by the attention.
    from minisgl_worker.engine import runner, startup

    monkeypatch.setattr(runner, "window_layout", lambda *a: startup.WindowLayout())
    engine = Engine(EngineConfig(model_path=str(path), page_size=4, num_pages=16, max_slots=2,
                                 attention_backend="torch"))
    try:
        model = engine.model
        assert model.sliding_rotary is not None
        local, full = model.sliding_rotary.cos.data_ptr(), model.rotary.cos.data_ptr()
        chunks = [(0, 5), (5, 13)] + [(i, i + 1) for i in range(13, len(seq))]
        for step, (lo, hi) in enumerate(chunks):
            cos_seen.clear()
            req = ReqPlan(rid=0, slot=0, cache_len=lo, input_ids=seq[lo:hi],
                          new_pages=[0, 1, 2, 3] if step == 0 else [], sample=False)
            ours = engine.forward_logits(with_window_pages(engine, StepPlan(step, [req])))
            assert cos_seen == [local, local, full]  # layer types: sliding, sliding, full
            torch.testing.assert_close(ours, ref[lo:hi], atol=2e-4, rtol=1e-4)
    finally:
        engine.close()

