"""The sliding-window KV pool end to end: the real Scheduler over the real Engine on a tiny Mistral
with a window of 8, whose window pool holds far fewer tokens than the sequences it serves. Greedy
tokens must equal transformers' (full forwards, which mask keys outside the window), through
chunked prefill, overlap, many windows of decode and a multi-turn prefix hit; the windowed
layers' storage must not depend on the sequence length."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from minisgl_core.sampling import SamplingParams
from minisgl_scheduler import Scheduler, SchedulerConfig
from minisgl_worker.engine import Engine, EngineConfig

from .tiny_models import VOCAB, windowed_mistral

WINDOW, PS, WINDOW_PAGES = 8, 4, 12


def _model(path: Path):  # noqa: ANN202 - a transformers model
    model = windowed_mistral(WINDOW, seed=3)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def _run(sched: Scheduler, prompts: dict[int, list[int]], n: int) -> dict[int, tuple[list[int], int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for rid, p in prompts.items():
        sched.submit(rid, p, params)
    out: dict[int, tuple[list[int], int]] = {rid: ([], 0) for rid in prompts}
    while sched.has_work():
        for ev in sched.step():
            assert ev.error is None, ev.error
            toks, _ = out[ev.rid]
            out[ev.rid] = (toks + ev.token_ids, ev.cached_tokens)
        sched.check_invariants()
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    path = tmp_path_factory.mktemp("swa")
    hf = _model(path)
    # A window pool of 12 pages (48 tokens) for sequences of 200: only dropping KV outside the
    # window lets them run.
    engine = Engine(EngineConfig(model_path=str(path), dtype="float32", page_size=PS,
                                 num_pages=128, max_slots=2, max_prefill_tokens=16,
                                 window_pages=WINDOW_PAGES))
    sched = Scheduler(engine, SchedulerConfig(max_prefill_tokens=16, max_step_ms=0.0))
    yield hf, engine, sched
    sched.close()


def test_window_pool_is_small_and_fixed(served) -> None:  # noqa: ANN001
    _, engine, sched = served
    info = engine.info()
    assert (info.window_pages, info.window) == (WINDOW_PAGES, WINDOW)
    pool = engine.pool
    assert pool.window_layers == frozenset({0, 1})  # every Mistral layer is windowed
    for layer in range(2):  # storage: the window pool and its dummy page, whatever is served
        assert pool.k[layer].shape[0] == pool.v[layer].shape[0] == WINDOW_PAGES + 1
    assert sched.kv.windowed and sched.kv.window_pages == WINDOW_PAGES


def test_long_sequences_match_transformers(served) -> None:  # noqa: ANN001
    hf, engine, sched = served
    prompts = {1: [(5 * i + 1) % VOCAB for i in range(37)],
               2: [(11 * i + 7) % VOCAB for i in range(21)]}
    n = 160  # 200 tokens: 25 windows, four times what the window pool holds
    out = _run(sched, prompts, n)
    for rid, prompt in prompts.items():
        assert out[rid][0] == _hf_greedy(hf, prompt, n), rid
    assert (len(prompts[1]) + n) > 4 * WINDOW_PAGES * PS
    st = sched.stats()
    assert st.running == st.waiting == 0
    assert sched.kv.win_available == WINDOW_PAGES  # every window page back (free or cached)


def test_multi_turn_hit_matches_transformers(served) -> None:  # noqa: ANN001
    hf, engine, sched = served
    turn1 = [(3 * i + 2) % VOCAB for i in range(30)]
    first = _run(sched, {10: turn1}, 40)[10][0]
    assert first == _hf_greedy(hf, turn1, 40)
    turn2 = turn1 + first + [9, 8, 7, 6, 5]
    tokens, cached = _run(sched, {11: turn2}, 30)[11]
    assert cached >= 64  # the cached conversation, up to its last whole page
    assert tokens == _hf_greedy(hf, turn2, 30)


def test_shared_prefix_longer_than_the_window_hits(served) -> None:  # noqa: ANN001
    """Requests sharing a system prompt three windows long, arriving one after another while the
    earlier ones decode: the window pages at the end of the shared prefix, which the first
    request's window moved past, stay in the tree as cache, so every later request hits the
    shared prefix, and its tokens still equal transformers'."""
    hf, engine, sched = served
    system = [(7 * i + 3) % VOCAB for i in range(3 * WINDOW)]
    prompts = {20 + k: system + [(13 * k + j) % VOCAB for j in range(3)] for k in range(4)}
    n = 24
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out: dict[int, tuple[list[int], int]] = {rid: ([], 0) for rid in prompts}
    for rid, prompt in prompts.items():
        sched.submit(rid, prompt, params)
        for _ in range(6):  # the earlier ones prefill and decode past the shared prefix
            for ev in sched.step():
                assert ev.error is None, ev.error
                out[ev.rid] = (out[ev.rid][0] + ev.token_ids, ev.cached_tokens)
            sched.check_invariants()
    while sched.has_work():
        for ev in sched.step():
            assert ev.error is None, ev.error
            out[ev.rid] = (out[ev.rid][0] + ev.token_ids, ev.cached_tokens)
        sched.check_invariants()
    for rid, prompt in prompts.items():
        tokens, cached = out[rid]
        assert tokens == _hf_greedy(hf, prompt, n), rid
        if rid > 20:  # the shared prefix, whole pages of it
            assert cached == len(system), (rid, cached)
    assert sched.kv.win_available == WINDOW_PAGES
