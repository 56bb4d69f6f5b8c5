"""Sampler: greedy, seeded reproducibility, exact distributions, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from minisgl_core.sampling import SamplingParams
from minisgl_worker.sampling import Sampler, ops
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

CPU = torch.device("cpu")
EOS = 3


def make(max_slots: int = 8, vocab: int = 32, seed: int = 0) -> Sampler:
    return Sampler(max_slots, vocab, CPU, eos_token_ids=[EOS], seed=seed)


def run(s: Sampler, logits: torch.Tensor, slots: list[int], positions: list[int]):
    return s.sample(logits, torch.tensor(slots), torch.tensor(positions), host_slots=slots)


# -- greedy ------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    s = make()
    s.set_slot(0, SamplingParams(temperature=0.0), [])
    s.set_slot(1, SamplingParams(temperature=0.7, top_k=1), [])
    s.set_slot(2, SamplingParams(temperature=1.0), [])  # a sampled row in the same batch
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        logits = torch.randn(3, 32, generator=gen)
        out = run(s, logits, [0, 1, 2], [step] * 3)
        assert out.token_ids[:2].tolist() == logits[:2].argmax(dim=1).tolist()
        assert out.logprobs is None and out.top_ids is None


# -- seeded reproducibility --------------------------------------------------------------------


def _generate(s: Sampler, slot: int, others: list[int], steps: int) -> list[int]:
    """Decode `steps` tokens for a seeded request in `slot`, sharing the batch with `others`;
    the logits of each position are a fixed function of the position (a stand-in model)."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, repetition_penalty=1.3,
                            frequency_penalty=0.5)
    s.set_slot(slot, params, [5, 6, 7])
    s.observe_inputs(slot, [8, 9])
    for o in others:
        s.set_slot(o, SamplingParams(temperature=1.2, top_k=5), [])
    tokens = []
    for step in range(steps):
        pos = 5 + step
        ours = torch.randn(1, 32, generator=torch.Generator().manual_seed(pos))
        noise = torch.randn(len(others), 32)
        logits = torch.cat([noise[: len(others) // 2], ours, noise[len(others) // 2 :]])
        slots = others[: len(others) // 2] + [slot] + others[len(others) // 2 :]
        positions = [pos + 100 * (i + 1) for i in range(len(slots))]
        positions[len(others) // 2] = pos
        out = run(s, logits, slots, positions)
        tokens.append(int(out.token_ids[len(others) // 2]))
    return tokens


def test_seed_reproducible_across_batches_and_slots():
    alone = _generate(make(seed=1), 0, [], 12)
    crowded = _generate(make(seed=2), 5, [0, 1, 7, 3], 12)
    moved = _generate(make(seed=3), 7, [2], 12)
    assert alone == crowded == moved
    # And the seed matters: another seed gives another sequence.
    s = make()
    s.set_slot(0, SamplingParams(temperature=1.0, seed=99), [])
    logits = torch.zeros(12, 32)
    a = [int(run(s, logits[i : i + 1], [0], [i]).token_ids) for i in range(12)]
    s.set_slot(0, SamplingParams(temperature=1.0, seed=100), [])
    b = [int(run(s, logits[i : i + 1], [0], [i]).token_ids) for i in range(12)]
    assert a != b


def test_unseeded_requests_differ():
    s = make(max_slots=2)
    s.set_slot(0, SamplingParams(temperature=1.0), [])
    s.set_slot(1, SamplingParams(temperature=1.0), [])
    out = run(s, torch.zeros(2, 32), [0, 1], [0, 0])
    draws = [out.token_ids.tolist()]
    for p in range(1, 8):
        draws.append(run(s, torch.zeros(2, 32), [0, 1], [p, p]).token_ids.tolist())
    assert any(a != b for a, b in draws)


# -- exact distributions -----------------------------------------------------------------------

LOGITS = torch.tensor([2.0, 1.4, 1.0, 0.3, -0.2, -0.9, -1.7, 0.7])


def expected_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Straight from the definitions, in float64: temperature, top-k, top-p, min-p."""
    x = logits.double() / p.temperature
    probs = x.softmax(0)
    order = probs.argsort(descending=True).tolist()
    keep = order[: p.top_k] if p.top_k else order
    mass, kept = probs[keep].sum(), []
    for t in keep:  # smallest prefix whose renormalised mass reaches top_p
        if sum(probs[u] for u in kept) / mass >= p.top_p:
            assert abs(sum(probs[u] for u in kept) / mass - p.top_p) > 1e-3  # no knife edge
            break
        kept.append(t)
    pmax = probs[kept[0]]
    kept = [t for t in kept if probs[t] >= p.min_p * pmax]
    out = torch.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


def draw_counts(params: SamplingParams, rounds: int = 6, slots: int = 2000) -> torch.Tensor:
    s = Sampler(slots, len(LOGITS), CPU, seed=7)
    for i in range(slots):
        s.set_slot(i, params, [])
    counts = torch.zeros(len(LOGITS), dtype=torch.int64)
    slot_ids = list(range(slots))
    logits = LOGITS.repeat(slots, 1)
    for r in range(rounds):
        out = run(s, logits, slot_ids, [r] * slots)
        counts += torch.bincount(out.token_ids, minlength=len(LOGITS))
    return counts


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "a filtered token was drawn"
    e = probs[support] * n
    chi2 = ((counts[support] - e) ** 2 / e).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), chi2 / 2.0))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.7, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
    SamplingParams(temperature=1.3, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=6, top_p=0.93, min_p=0.1),
], ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_distribution_matches_definition(params: SamplingParams):
    counts = draw_counts(params)
    probs = expected_probs(LOGITS, params)
    assert chi2_pvalue(counts, probs) > 1e-3
    # The check has teeth: the plain softmax (no temperature/filters) is rejected.
    plain = LOGITS.double().softmax(0)
    if not torch.allclose(probs, plain, atol=0.02):
        with pytest.raises(AssertionError):
            assert chi2_pvalue(counts, plain) > 1e-3


def test_mixed_batch_each_row_its_own_distribution():
    """Per-row parameters in one batch: rows with top-k next to rows with top-p and min-p."""
    a = SamplingParams(temperature=1.7, top_k=3)
    b = SamplingParams(temperature=1.0, top_p=0.8)
    c = SamplingParams(temperature=1.3, min_p=0.2)
    n = 1500
    s = Sampler(3 * n, len(LOGITS), CPU, seed=3)
    for i in range(3 * n):
        s.set_slot(i, (a, b, c)[i % 3], [])
    slots = list(range(3 * n))
    counts = torch.zeros(3, len(LOGITS), dtype=torch.int64)
    for r in range(4):
        tok = run(s, LOGITS.repeat(3 * n, 1), slots, [r] * (3 * n)).token_ids.view(n, 3)
        for j in range(3):
            counts[j] += torch.bincount(tok[:, j], minlength=len(LOGITS))
    for j, p in enumerate((a, b, c)):
        assert chi2_pvalue(counts[j], expected_probs(LOGITS, p)) > 1e-3


# -- penalties and min_tokens ------------------------------------------------------------------


def test_repetition_penalty_matches_hf():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 50, generator=gen) * 3
    ids = torch.randint(0, 50, (4, 12), generator=gen)
    seen = torch.zeros(4, 50, dtype=torch.bool).scatter_(1, ids, True)
    for penalty in (0.7, 1.0, 1.6):
        ours = ops.apply_repetition_penalty(x, seen, torch.full((4,), penalty))
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(ids, x.clone())
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def reference_logits(x: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
                     stops: list[int]) -> torch.Tensor:
    x = x.clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= output.count(t) * p.frequency_penalty + p.presence_penalty
    if len(output) < p.min_tokens:
        x[stops] = -math.inf
    return x


@settings(max_examples=8, deadline=None)
@given(
    rep=st.sampled_from([1.0, 0.8, 1.3, 2.0]),
    pres=st.sampled_from([0.0, -0.5, 1.0]),
    freq=st.sampled_from([0.0, 0.4, -0.3, 1.5]),
    min_tokens=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_penalties_against_reference(rep, pres, freq, min_tokens, seed):
    """Greedy decoding of three requests over shared logits: each step's token must be the
    argmax of the reference-penalised logits, with sampled tokens feeding later steps."""
    vocab = 24
    gen = torch.Generator().manual_seed(seed)
    s = Sampler(6, vocab, CPU, eos_token_ids=[EOS, 4], seed=0)
    reqs = []
    for slot in (1, 4, 5):
        p = SamplingParams(temperature=0.0, repetition_penalty=rep, presence_penalty=pres,
                           frequency_penalty=freq, min_tokens=min_tokens,
                           stop_token_ids=[7] if slot == 4 else [])
        history = torch.randint(0, vocab, (5,), generator=gen).tolist()
        fed = torch.randint(0, vocab, (3,), generator=gen).tolist()
        s.set_slot(slot, p, history)
        s.observe_inputs(slot, fed)
        stops = [EOS, 4] + p.stop_token_ids
        reqs.append((slot, p, history + fed, [], stops))
    for step in range(8):
        # Small spread so the penalties decide; EOS made attractive so min_tokens matters.
        logits = torch.randn(3, vocab, generator=gen) * 0.5
        logits[:, EOS] += 1.0
        out = run(s, logits, [r[0] for r in reqs], [10 + step] * 3)
        for i, (_, p, prompt, output, stops) in enumerate(reqs):
            expect = reference_logits(logits[i], p, prompt, output, stops).argmax()
            assert int(out.token_ids[i]) == int(expect), (step, i)
            output.append(int(out.token_ids[i]))


def test_min_tokens_masks_eos_and_stop_tokens():
    s = make()
    s.set_slot(0, SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9]), [])
    s.set_slot(1, SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True), [])
    logits = torch.zeros(2, 32)
    logits[:, EOS], logits[:, 9], logits[:, 11] = 10.0, 9.0, 1.0
    got = [run(s, logits, [0, 1], [i, i]).token_ids.tolist() for i in range(4)]
    assert [g[0] for g in got] == [11, 11, 11, EOS]
    assert [g[1] for g in got] == [EOS, EOS, EOS, EOS]  # EOS is no stop token with ignore_eos


def test_restart_resets_slot_state():
    s = make()
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    logits = torch.zeros(1, 32)
    logits[0, 5] = 1.0
    s.set_slot(0, p, [])
    first = [int(run(s, logits, [0], [i]).token_ids) for i in range(3)]
    assert first[0] == 5 and first[1] != 5  # the count of token 5 now weighs
    s.set_slot(0, p, [])  # a new request in the same slot starts from zero counts
    assert [int(run(s, logits, [0], [i]).token_ids) for i in range(3)] == first


# -- logprobs ----------------------------------------------------------------------------------


def test_logprobs_and_top_alternatives():
    s = make()
    s.set_slot(0, SamplingParams(temperature=1.0, logprobs=True, top_logprobs=3,
                                 repetition_penalty=1.5), [1, 2])
    s.set_slot(1, SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5), [])
    s.set_slot(2, SamplingParams(temperature=0.5), [])
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(4)) * 2
    out = run(s, logits, [0, 1, 2], [3, 3, 3])
    raw = logits.log_softmax(dim=1)  # the raw model distribution, whatever the processing
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == (3, 5) and out.top_logprobs.shape == (3, 5)
    order = raw.argsort(dim=1, descending=True)[:, :5]
    assert out.top_ids.tolist() == order.tolist()
    torch.testing.assert_close(out.top_logprobs, raw.gather(1, order))
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()


def test_no_logprobs_when_nobody_asks():
    s = make()
    s.set_slot(0, SamplingParams(top_logprobs=4), [])  # top_logprobs without logprobs: off
    out = run(s, torch.randn(1, 32), [0], [0])
    assert out.logprobs is None and out.top_ids is None


# -- bad input ---------------------------------------------------------------------------------


def test_bad_input_is_refused():
    s = make()
    with pytest.raises(ValueError, match="slot"):
        s.set_slot(8, SamplingParams(), [])
    with pytest.raises(ValueError, match="stop_token_ids"):
        s.set_slot(0, SamplingParams(stop_token_ids=[32]), [])
    s.set_slot(0, SamplingParams(repetition_penalty=1.2), [])
    with pytest.raises(ValueError, match="input token ids"):
        s.observe_inputs(0, [-1])
    with pytest.raises(ValueError, match="logits"):
        run(s, torch.zeros(1, 31), [0], [0])
    with pytest.raises(ValueError, match="slots"):
        run(s, torch.zeros(1, 32), [9], [0])
    assert run(s, torch.zeros(0, 32), [], []).token_ids.shape == (0,)


def test_large_vocab_chunked_noise_matches_single_pass():
    keys = ops.row_keys(torch.tensor([1, 2**40 + 3]), torch.tensor([0, 77]))
    x = torch.randn(2, 5000, generator=torch.Generator().manual_seed(0))
    th = ops.token_hashes(5000, CPU)
    a = ops.gumbel_argmax_torch(x, keys, th)
    b = ops.gumbel_argmax_torch(x, keys, th, chunk=1024)
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize("where", ["history", "inputs"])
def test_recomputed_outputs_count_for_presence_penalty(where: str):
    """After a preemption a request restarts with its earlier outputs as history or inputs; the
    presence penalty must still count them as outputs (positions >= num_prompt_tokens), exactly
    as if the request had never been preempted."""
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, max_tokens=8)
    logits = torch.zeros(1, 32)
    logits[0, 5], logits[0, 6] = 3.0, 2.0  # 5 wins unless it is penalised as an earlier output
    seq = [9, 10, 5]  # prompt [9, 10], then the earlier output 5

    def first_token(num_prompt_tokens: int | None) -> int:
        s = make()
        if where == "history":
            s.set_slot(0, params, seq, num_prompt_tokens)
        else:
            s.set_slot(0, params, [], num_prompt_tokens)
            s.observe_inputs(0, seq, 0)
        return run(s, logits, [0], [len(seq)]).token_ids.tolist()[0]

    reference = make()  # never preempted: it sampled 5 itself, then is penalised for it
    reference.set_slot(0, params, [], 2)
    reference.observe_inputs(0, [9, 10], 0)
    assert run(reference, logits, [0], [2]).token_ids.tolist()[0] == 5
    assert run(reference, logits, [0], [3]).token_ids.tolist()[0] == 6
    assert first_token(2) == 6  # 5 sits past the prompt: penalised like the reference
    assert first_token(None) == 5  # unknown prompt length: everything counts as prompt
