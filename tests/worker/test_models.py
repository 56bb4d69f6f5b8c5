"""Every architecture against HF transformers on the same tiny random weights (fp32, CPU):
logits of a batch of prompts, and greedy generation through the engine's step API."""

from __future__ import annotations

import pytest
import torch
from minisgl_core.step import ReqPlan, StepPlan
from minisgl_worker.engine import Engine, EngineConfig

from .driver import run_requests, with_window_pages
from .tiny_models import ARCHS, VOCAB, build_hf_model

PAGE = 4
PROMPTS = [[(7 * i + 3) % VOCAB for i in range(13)], [(11 * i + 5) % VOCAB for i in range(6)],
           [1, 2, 3]]


def make_engine(path: object, **kw: object) -> Engine:
    cfg = dict(model_path=str(path), page_size=PAGE, num_pages=128, max_slots=8)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request: pytest.FixtureRequest, tiny_model):  # noqa: ANN001, ANN201
    arch = request.param
    return arch, tiny_model(arch), build_hf_model(arch)


def test_logits_match_hf(arch_case) -> None:  # noqa: ANN001
    _, path, hf = arch_case
    engine = make_engine(path)
    reqs, next_page = [], 0
    for i, p in enumerate(PROMPTS):  # all prompts in one step: a ragged batch over shared pages
        n = -(-len(p) // PAGE)
        reqs.append(ReqPlan(rid=i, slot=i, cache_len=0, input_ids=p,
                            new_pages=list(range(next_page, next_page + n)), sample=False))
        next_page += n
    logits = engine.forward_logits(with_window_pages(engine, StepPlan(0, reqs)))
    start = 0
    for p in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        ours = logits[start:start + len(p)]
        start += len(p)
        assert ref.abs().max() > 1.0  # peaked enough to make the comparison meaningful
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    engine.close()


def test_greedy_generation_matches_hf(arch_case) -> None:  # noqa: ANN001
    _, path, hf = arch_case
    new = 12
    engine = make_engine(path)
    ours = run_requests(engine, PROMPTS, new, PAGE)  # batched, overlapped, paged
    for p, got in zip(PROMPTS, ours, strict=True):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert got == ref
    engine.close()


def test_llama3_rope_scaling_matches_hf() -> None:
    from minisgl_worker.layers.rotary import inv_frequencies
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                      rope_scaling=scaling, max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = inv_frequencies(128, 500000.0, scaling)
    plain = inv_frequencies(128, 500000.0, None)
    torch.testing.assert_close(ours, ref.float())
    assert not torch.allclose(ours, plain)  # the scaling really changes something


@pytest.mark.parametrize("page_size", [1, 16])
def test_logits_match_hf_over_chunks_and_32_decode_steps(arch_case, page_size: int) -> None:  # noqa: ANN001
    """Teacher-forced: a 13-token prompt in two chunks (5 + 8), then 32 one-token steps; every
    position's logits against HF's over the whole 45-token sequence."""
    _, path, hf = arch_case
    seq = PROMPTS[0] + [(5 * i + 1) % VOCAB for i in range(32)]
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].float()
    engine = make_engine(path, page_size=page_size, num_pages=64)
    pages = list(range(-(-len(seq) // page_size)))
    chunks = [(0, 5), (5, 13)] + [(i, i + 1) for i in range(13, len(seq))]
    for step, (lo, hi) in enumerate(chunks):
        req = ReqPlan(rid=0, slot=0, cache_len=lo, input_ids=seq[lo:hi],
                      new_pages=pages if step == 0 else [], sample=False)
        ours = engine.forward_logits(with_window_pages(engine, StepPlan(step, [req])))
        torch.testing.assert_close(ours, ref[lo:hi], atol=2e-4, rtol=1e-4)
    engine.close()


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_32_tokens_match_hf(arch_case, page_size: int) -> None:  # noqa: ANN001
    _, path, hf = arch_case
    engine = make_engine(path, page_size=page_size, num_pages=256)
    ours = run_requests(engine, PROMPTS, 32, page_size)
    for p, got in zip(PROMPTS, ours, strict=True):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert got == ref
    engine.close()
