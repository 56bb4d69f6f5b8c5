"""The in-process LLM: the real Scheduler over the worker's real Engine on the embedded tiny model.

Greedy tokens must equal a plain transformers forward loop on the same weights, and scheduling
choices (overlap, chunked prefill, prefix cache, preemption) must never change them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from minisgl.llm import LLM
from minisgl_core.sampling import SamplingParams
from minisgl_scheduler import ContextLengthExceeded

PROMPTS = ["Once upon a time", "The little dog ran to the", "In the beginning there was",
           "Hello", "Once upon a time there was a little girl who"]
ENGINE = dict(dtype="float32", page_size=4, max_slots=16)


@pytest.fixture(scope="module")
def llm(tiny_model_path: Path) -> Iterator[LLM]:
    with LLM(tiny_model_path, num_pages=1024, **ENGINE) as engine:  # type: ignore[arg-type]
        yield engine


def hf_greedy(model_path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens per prompt from full forward passes (no KV cache, no batching)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            for _ in range(n):
                logits = model(torch.tensor([seq])).logits[0, -1]
                seq.append(int(logits.argmax()))
            outs.append(seq[len(ids):])
    return outs


def test_greedy_matches_transformers(llm: LLM, tiny_model_path: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    want = hf_greedy(tiny_model_path, [llm.encode(p) for p in PROMPTS], 10)
    assert [o["token_ids"] for o in outs] == want
    for o in outs:
        assert o["finish_reason"] == "length" and o["text"] == llm.decode(o["token_ids"])


def test_text_and_token_prompts_agree(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    by_text = llm.generate(PROMPTS[:2], params)
    by_ids = llm.generate([llm.encode(p) for p in PROMPTS[:2]], params)
    assert [o["token_ids"] for o in by_text] == [o["token_ids"] for o in by_ids]
    assert by_text[0]["prompt_tokens"] == len(llm.encode(PROMPTS[0]))


PARAMS = [SamplingParams(temperature=0.0, max_tokens=6 + 5 * (i % 3)) for i in range(8)]


def _outputs(engine: LLM) -> list[tuple[list[int], str]]:
    outs = engine.generate((PROMPTS * 2)[:8], PARAMS)
    return [(o["token_ids"], o["finish_reason"]) for o in outs]


def test_scheduling_choices_never_change_greedy_outputs(llm: LLM, tiny_model_path: Path) -> None:
    overlapped = _outputs(llm)  # overlap on, radix cache, roomy pool
    with LLM(tiny_model_path, num_pages=1024, disable_overlap=True, cache="naive",
             **ENGINE) as plain:  # type: ignore[arg-type]
        assert _outputs(plain) == overlapped
    # A pool too small for the batch, tiny prefill chunks and a queue shorter than the batch:
    # preemption, recomputation, chunking, prefix hits and Overloaded retries all happen, and the
    # tokens stay the same.
    assert _squeezed_outputs(tiny_model_path, ENGINE) == overlapped


def _squeezed_outputs(path: Path, engine: dict) -> list[tuple[list[int], str]]:
    """_outputs from an LLM whose pool, prefill chunks and queue are all too small for the
    batch; checks that preemption and prefix hits happened and every page came back."""
    with LLM(path, num_pages=14, max_prefill_tokens=6, decode_reserve_ratio=0.0,
             max_queued_requests=3, **engine) as squeezed:  # type: ignore[arg-type]
        outs = _outputs(squeezed)
        stats = squeezed.scheduler.stats()
        # the worker's TP all-reduce buffer is sized for this scheduler's steps
        assert squeezed.engine.config.two_shot_step_tokens() == 6 + squeezed.engine.config.max_slots
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0
    assert stats.used_pages == 0
    return outs


def test_offline_default_prefill_chunk_reaches_scheduler_and_worker(llm: LLM) -> None:
    """The LLM prefills 16,384 prompt tokens a step unless told otherwise (the services: 8,192),
    and the worker's TP all-reduce buffer is sized for the same steps."""
    from minisgl_core.config import DEFAULT_MAX_PREFILL_TOKENS, OFFLINE_MAX_PREFILL_TOKENS
    from minisgl_scheduler import SchedulerConfig

    assert (OFFLINE_MAX_PREFILL_TOKENS, DEFAULT_MAX_PREFILL_TOKENS) == (16384, 8192)
    assert SchedulerConfig().max_prefill_tokens == DEFAULT_MAX_PREFILL_TOKENS
    assert llm.scheduler.config.max_prefill_tokens == OFFLINE_MAX_PREFILL_TOKENS
    cfg = llm.engine.config
    assert cfg.two_shot_step_tokens() == OFFLINE_MAX_PREFILL_TOKENS + cfg.max_slots


def test_bad_prompts_raise_clear_errors(llm: LLM) -> None:
    with pytest.raises(ContextLengthExceeded, match="context window"):
        llm.generate([[5] * 5000], SamplingParams(max_tokens=4))
    assert llm.scheduler.stats().used_pages == 0
    assert not llm.scheduler.has_work()


def test_fp8_kv_cache_through_the_scheduler(tiny_model_path: Path) -> None:
    """An fp8 KV cache under the real scheduler: preemption, recomputation, chunking and prefix
    hits give the same greedy tokens as a roomy fp8 pool (each token's K/V rounds to the same
    fp8 values whichever way it is computed), and every page comes back."""
    fp8 = dict(ENGINE, kv_cache_dtype="fp8_e4m3")
    with LLM(tiny_model_path, num_pages=1024, **fp8) as roomy:  # type: ignore[arg-type]
        assert roomy.engine.pool.k[0].dtype == torch.float8_e4m3fn
        want = _outputs(roomy)
    assert _squeezed_outputs(tiny_model_path, fp8) == want


def test_fp8_weights_through_the_scheduler(llm: LLM, tiny_model_path: Path) -> None:
    """--quantization fp8 (dense projections as fp8 rows): scheduling choices still never
    change greedy tokens (activations are quantized per token, whatever the batch), they are
    (almost all) the unquantized model's, and every page comes back."""
    quant = dict(ENGINE, quantization="fp8")
    with LLM(tiny_model_path, num_pages=1024, **quant) as roomy:  # type: ignore[arg-type]
        layer = roomy.engine.model.model.layers[0]
        assert layer.mlp.down_proj.weight.dtype == torch.float8_e4m3fn
        want = _outputs(roomy)
    plain = _outputs(llm)
    same = sum(a == b for w, p in zip(want, plain, strict=True) for a, b in zip(w[0], p[0], strict=False))
    assert same >= 0.9 * sum(len(w[0]) for w in want)  # measured: all 83 tokens equal
    assert _squeezed_outputs(tiny_model_path, quant) == want
