"""The engine's step contract on a tiny Qwen3: chunked prefill, mixed batches, prefix reuse,
token futures under overlap, bad plans, logprobs."""

from __future__ import annotations

import pytest
import torch
from minisgl_core.sampling import SamplingParams
from minisgl_core.step import DecodeEntries, ReqPlan, StepPlan
from minisgl_worker.engine import Engine, EngineConfig
from minisgl_worker.engine.batch import InvalidPlan

from .driver import GREEDY, run_requests
from .tiny_models import VOCAB

PAGE = 4
PROMPTS = [[(13 * i + 1) % VOCAB for i in range(21)], [(5 * i + 9) % VOCAB for i in range(9)],
           [(3 * i + 2) % VOCAB for i in range(14)]]
NEW = 8


@pytest.fixture(scope="module")
def engine(tiny_model) -> Engine:  # noqa: ANN001
    eng = Engine(EngineConfig(model_path=str(tiny_model("qwen3")), page_size=PAGE,
                              num_pages=256, max_slots=8))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(engine: Engine) -> list[list[int]]:
    """Each prompt alone, prefilled in one step, no overlap."""
    return [run_requests(engine, [p], NEW, PAGE, overlap=False)[0] for p in PROMPTS]


def test_batched_overlapped_equals_alone(engine: Engine, reference: list[list[int]]) -> None:
    assert run_requests(engine, PROMPTS, NEW, PAGE) == reference


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunked_prefill_same_tokens(engine: Engine, reference: list[list[int]],
                                     chunk: int) -> None:
    assert run_requests(engine, PROMPTS, NEW, PAGE, chunk=chunk) == reference


def test_mixed_prefill_and_decode(engine: Engine, reference: list[list[int]]) -> None:
    # Requests arrive while others decode; one is chunked across steps that also carry decodes.
    out = run_requests(engine, PROMPTS, NEW, PAGE, chunk=5, starts=[0, 2, 3])
    assert out == reference


def _prefill(slot: int, ids: list[int], pages: list[int], cache_len: int = 0,
             offset: int = 0) -> ReqPlan:
    return ReqPlan(rid=slot, slot=slot, cache_len=cache_len, input_ids=ids, page_offset=offset,
                   new_pages=pages, sample=False)


def test_prefix_reuse_same_logits(engine: Engine) -> None:
    prompt = PROMPTS[0]  # 21 tokens: pages 0..5
    full = engine.forward_logits(StepPlan(0, [_prefill(0, prompt, list(range(40, 46)))]))
    # Slot 1 reuses the first two full pages (8 tokens) of slot 0 and computes the rest.
    shared = [40, 41]
    rest = engine.forward_logits(StepPlan(1, [
        ReqPlan(rid=1, slot=1, cache_len=8, input_ids=prompt[8:], new_pages=shared + [50, 51, 52, 53],
                sample=False)]))
    torch.testing.assert_close(rest, full[8:], atol=1e-5, rtol=1e-5)
    # And a bigger cache_len than pages written in one go: page_offset appends later pages.
    engine.forward_logits(StepPlan(2, [_prefill(2, prompt[:12], [40, 41, 60])]))
    tail = engine.forward_logits(StepPlan(3, [_prefill(2, prompt[12:], [61, 62, 63], 12, 3)]))
    torch.testing.assert_close(tail, full[12:], atol=1e-5, rtol=1e-5)


def test_only_sampling_requests_answer(engine: Engine) -> None:
    plan = StepPlan(7, [
        ReqPlan(rid=10, slot=0, cache_len=0, input_ids=[1, 2, 3], new_pages=[0], sample=False,
                sampling=GREEDY),
        ReqPlan(rid=11, slot=1, cache_len=0, input_ids=[4, 5], new_pages=[1], sampling=GREEDY),
    ])
    out = engine.step(plan)
    assert out.step_id == 7 and out.rids == [11] and len(out.token_ids) == 1
    assert out.logprobs == [] and out.forward_ms > 0
    empty = engine.step(StepPlan(8, []))
    assert empty.rids == [] and empty.token_ids == []


def test_logprobs(engine: Engine) -> None:
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    prompt = PROMPTS[1]
    out = engine.step(StepPlan(0, [ReqPlan(rid=1, slot=2, cache_len=0, input_ids=prompt,
                                           new_pages=[5, 6, 7], sampling=params)]))
    logits = engine.forward_logits(StepPlan(1, [_prefill(3, prompt, [8, 9, 10])]))[-1]
    ref = torch.log_softmax(logits, -1)
    tok = int(ref.argmax())
    assert out.token_ids == [tok]
    assert out.logprobs[0] == pytest.approx(float(ref[tok]), abs=1e-5)
    top = out.top_logprobs[0]
    assert top.token_ids == ref.topk(3).indices.tolist()
    assert top.logprobs == pytest.approx(ref.topk(3).values.tolist(), abs=1e-5)


@pytest.mark.parametrize("bad, message", [
    (ReqPlan(rid=1, slot=99, cache_len=0, input_ids=[1], new_pages=[0]), "slot 99"),
    (ReqPlan(rid=1, slot=0, cache_len=0, input_ids=[VOCAB], new_pages=[0]), "token ids"),
    (ReqPlan(rid=1, slot=0, cache_len=0, input_ids=[1], new_pages=[10_000]), "page ids"),
    (ReqPlan(rid=1, slot=0, cache_len=0, input_ids=[1] * 9, new_pages=[0, 1]), "pages"),
    (ReqPlan(rid=1, slot=5, cache_len=3, input_ids=[], new_pages=[0]), "without input_ids"),
    (DecodeEntries([1], [5], [3], [0], [1], [0]), "decode step"),
    (DecodeEntries([1], [5], [3], [0], [2], [0]), "decode columns"),
    (ReqPlan(rid=1, slot=0, cache_len=250, input_ids=[1] * 10, new_pages=list(range(64))),
     "max_model_len"),
])
def test_bad_plans_are_refused_without_side_effects(engine: Engine, reference: list[list[int]],
                                                    bad: ReqPlan | DecodeEntries,
                                                    message: str) -> None:
    good = ReqPlan(rid=2, slot=1, cache_len=0, input_ids=[1, 2], new_pages=[3])
    plan = (StepPlan(0, [good], decodes=bad) if isinstance(bad, DecodeEntries)
            else StepPlan(0, [good, bad]))
    with pytest.raises(InvalidPlan, match=message):
        engine.launch(plan)
    # Nothing was queued and the engine still serves.
    assert run_requests(engine, PROMPTS[:1], NEW, PAGE) == reference[:1]


def test_duplicate_slot_refused(engine: Engine) -> None:
    r = ReqPlan(rid=1, slot=0, cache_len=0, input_ids=[1], new_pages=[0])
    with pytest.raises(InvalidPlan, match="twice"):
        engine.launch(StepPlan(0, [r, r]))


def test_info(engine: Engine) -> None:
    info = engine.info()
    assert (info.num_pages, info.page_size, info.max_slots, info.vocab_size) == (256, PAGE, 8, VOCAB)
    assert info.max_model_len == 256 and info.attention_backend == "torch"
    assert info.device == "cpu" and info.tp_size == 1


def test_prefill_warm_up_leaves_the_engine_as_it_was(engine: Engine,
                                                     reference: list[list[int]]) -> None:
    """The start-up warm-up (run on every device; on CUDA it makes FlashInfer's prefill kernels
    compile before the first request) writes page 0 through slot 0 and then hands both back
    untouched: slot 0 holds no pages and no token future, and requests give the same tokens
    after it."""
    assert engine.warm_up_prefill() >= 0
    assert engine.builder.pages_len[0] == 0 and not engine.builder.has_future[0]
    decode = DecodeEntries()
    decode.add(rid=1, slot=0, cache_len=3)  # slot 0 holds no page: refused, not read stale
    with pytest.raises(InvalidPlan):
        engine.step(StepPlan(1, decodes=decode))
    assert run_requests(engine, PROMPTS, NEW, PAGE) == reference
