"""gpt-oss on the GPU: the Triton MoE kernels with expert biases and the clamped SwiGLU against
the torch reference (the CPU path, itself checked against HF in tests/worker/test_gpt_oss.py),
and the tiny gpt-oss model's engine on CUDA against HF transformers.

    TRITON_INTERPRET=0 python3 -m pytest -q tests/gpu/test_gpt_oss.py
"""

from __future__ import annotations

import pytest
import torch
from minisgl_worker.kernels.clamped_swiglu import ClampedSwiGLU
from minisgl_worker.kernels.fused_moe import fused_moe_triton, moe_reference, quantize_experts

E, K = 32, 4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _experts(h: int, inter: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(dtype)

    # gate/up values ~ N(0, 4^2) before the bias: a good share beyond the limit 7
    return dict(w13=rand(E, 2 * inter, h, scale=4.0 / h**0.5), w2=rand(E, h, inter, scale=inter**-0.5),
                w13_bias=rand(E, 2 * inter, scale=1.0), w2_bias=rand(E, h, scale=1.0))


def _route(t: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(t, E, generator=g, device="cuda")
    top, ids = torch.topk(logits, K, dim=-1)
    return torch.softmax(top, dim=-1).to(dtype), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 7, 32, 100, 600, 3000])
def test_triton_experts_with_biases_and_clamp(t: int, dtype: torch.dtype) -> None:
    h, inter = 2880, 1440  # gpt-oss-20b's hidden size, its intermediate size at TP=2
    w = _experts(h, inter, dtype)
    x = torch.randn(t, h, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    x = x.to(dtype)
    weights, ids = _route(t, dtype)
    act = ClampedSwiGLU(1.702, 7.0)
    ours = fused_moe_triton(x, w["w13"], w["w2"], ids, weights, w13_bias=w["w13_bias"],
                            w2_bias=w["w2_bias"], activation=act)
    ref = moe_reference(x.float(), w["w13"].float(), w["w2"].float(), ids, weights.float(),
                        w13_bias=w["w13_bias"].float(), w2_bias=w["w2_bias"].float(),
                        activation=act)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(ours, ref) < tol
    # the bias and the clamp are really computed: leaving either out is far off
    no_clamp = moe_reference(x.float(), w["w13"].float(), w["w2"].float(), ids, weights.float(),
                             w13_bias=w["w13_bias"].float(), w2_bias=w["w2_bias"].float(),
                             activation=ClampedSwiGLU(1.702, 1e9))
    no_bias = moe_reference(x.float(), w["w13"].float(), w["w2"].float(), ids, weights.float(),
                            activation=act)
    assert rel_err(no_clamp, ref) > 0.1 and rel_err(no_bias, ref) > 0.1


@pytest.mark.parametrize("t", [3, 300, 2000])
def test_triton_fp8_experts_with_biases_and_clamp(t: int) -> None:
    h, inter = 2880, 1440
    w = _experts(h, inter, torch.bfloat16)
    q13, s13 = quantize_experts(w["w13"])
    q2, s2 = quantize_experts(w["w2"])
    x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
    weights, ids = _route(t, torch.bfloat16)
    act = ClampedSwiGLU(1.702, 7.0)
    args = dict(w13_bias=w["w13_bias"], w2_bias=w["w2_bias"], activation=act)
    ours = fused_moe_triton(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2, **args)
    ref = moe_reference(x, q13, q2, ids, weights, s13, s2, **args)
    assert rel_err(ours, ref) < 2e-2


def test_tiny_gpt_oss_engine_on_cuda_matches_hf(tmp_path) -> None:  # noqa: ANN001
    """fp32 on CUDA (Triton experts; "auto" attention, the triton backend with sinks and windows):
    a prompt in two chunks then 32 decode steps, every position's logits against HF's (CPU)."""
    from minisgl_core.step import ReqPlan, StepPlan
    from minisgl_worker.engine import Engine, EngineConfig
    from worker.driver import with_window_pages
    from worker.tiny_models import VOCAB, build_hf_model, save_tiny

    path = save_tiny("gpt_oss", tmp_path / "tiny")
    hf = build_hf_model("gpt_oss")
    seq = [(7 * i + 3) % VOCAB for i in range(13)] + [(5 * i + 1) % VOCAB for i in range(32)]
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].float()
    engine = Engine(EngineConfig(model_path=str(path), page_size=16, num_pages=64, max_slots=8,
                                 device="cuda", dtype="float32"))
    try:
        pages = list(range(-(-len(seq) // 16)))
        chunks = [(0, 5), (5, 13)] + [(i, i + 1) for i in range(13, len(seq))]
        for step, (lo, hi) in enumerate(chunks):
            req = ReqPlan(rid=0, slot=0, cache_len=lo, input_ids=seq[lo:hi],
                          new_pages=pages if step == 0 else [], sample=False)
            ours = engine.forward_logits(with_window_pages(engine, StepPlan(step, [req])))
            ours = ours.float().cpu()
            torch.testing.assert_close(ours, ref[lo:hi], atol=5e-4, rtol=1e-3)
    finally:
        engine.close()
