"""Grammar masks and logit biases in the sampler, on random logits and the tiny model's real
tokenizer: whatever the logits say, the drawn text matches the grammar and ends with EOS."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from minisgl_core.sampling import GrammarSpec, SamplingParams
from minisgl_worker.sampling import Sampler
from tokenizers import Tokenizer

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
VOCAB = 4096
EOS = [2, 0]


def _run(sampler: Sampler, params: list[SamplingParams], steps: int,
         seed: int = 0) -> list[list[int]]:
    """Drives the sampler like the engine: each row samples once per step, one step behind."""
    gen = torch.Generator().manual_seed(seed)
    for slot, p in enumerate(params):
        sampler.set_slot(slot, p, [5, 6, 7])
    out: list[list[int]] = [[] for _ in params]
    done = [False] * len(params)
    slots = torch.arange(len(params))
    for step in range(steps):
        logits = torch.randn(len(params), VOCAB, generator=gen) * 5
        tokens = sampler.sample(logits, slots, torch.full((len(params),), 3 + step),
                                host_slots=slots.tolist()).token_ids.tolist()
        for i, t in enumerate(tokens):
            if not done[i]:
                out[i].append(t)
                done[i] = t in EOS
    return out


def _text(ids: list[int]) -> str:
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    assert ids[-1] in EOS, "the grammar must end the output with EOS"
    return tok.decode(ids[:-1])


def test_json_schema_and_regex_rows_match_while_a_plain_row_is_free() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    sampler = Sampler(4, VOCAB, torch.device("cpu"), eos_token_ids=EOS, seed=0,
                      tokenizer_path=str(TINY / "tokenizer.json"))
    params = [SamplingParams(temperature=1.0, grammar=GrammarSpec("json_schema",
                                                                  json.dumps(schema))),
              SamplingParams(temperature=0.0, grammar=GrammarSpec("regex", "[0-9]{2,4}-x")),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, grammar=GrammarSpec("json_object"))]
    outs = _run(sampler, params, 120)
    jsonschema.validate(json.loads(_text(outs[0])), schema)
    import re
    assert re.fullmatch(r"[0-9]{2,4}-x", _text(outs[1]))
    assert isinstance(json.loads(_text(outs[3])), dict)
    # The unconstrained row drew from the whole vocabulary.
    assert len(set(outs[2])) > 50


def test_logit_bias_bans_and_forces_tokens() -> None:
    sampler = Sampler(2, VOCAB, torch.device("cpu"), eos_token_ids=EOS, seed=0)
    ban = SamplingParams(temperature=1.0, ignore_eos=True, logit_bias={17: -100.0})
    force = SamplingParams(temperature=1.0, ignore_eos=True, logit_bias={17: 100.0})
    gen = torch.Generator().manual_seed(1)
    sampler.set_slot(0, ban)
    sampler.set_slot(1, force)
    slots = torch.arange(2)
    for step in range(50):
        logits = torch.randn(2, VOCAB, generator=gen)
        logits[0, 17] = 30.0  # the banned token would win every draw without the bias
        tokens = sampler.sample(logits, slots, torch.full((2,), step)).token_ids.tolist()
        assert tokens[0] != 17 and tokens[1] == 17


def test_invalid_grammar_ends_the_request_with_eos() -> None:
    sampler = Sampler(1, VOCAB, torch.device("cpu"), eos_token_ids=EOS, seed=0,
                      tokenizer_path=str(TINY / "tokenizer.json"))
    outs = _run(sampler, [SamplingParams(grammar=GrammarSpec("regex", "a(+"))], 3)
    assert outs[0][0] in EOS


@pytest.mark.parametrize("bad", [{3: 1.0}])
def test_out_of_range_bias_token_is_refused(bad: dict[int, float]) -> None:
    sampler = Sampler(1, 3, torch.device("cpu"))
    with pytest.raises(ValueError, match="logit_bias"):
        sampler.set_slot(0, SamplingParams(logit_bias=bad))


def test_triton_bitmask_kernel_matches_the_torch_path() -> None:
    """The CUDA kernel (run by Triton's interpreter here) masks exactly what torch ops mask."""
    from minisgl_worker.sampling.grammar_mask import apply_bitmask

    gen = torch.Generator().manual_seed(0)
    vocab = 4100  # not a multiple of 32: the last word is partly outside the vocabulary
    x = torch.randn(5, vocab, generator=gen)
    rows = torch.tensor([4, 0, 2])
    bits = torch.randint(-2**31, 2**31 - 1, (3, -(-vocab // 32)), generator=gen,
                         dtype=torch.int64).to(torch.int32)
    ref, out = x.clone(), x.clone()
    apply_bitmask(ref, rows, bits, use_triton=False)
    apply_bitmask(out, rows, bits, use_triton=True)
    assert torch.equal(ref, out)
    assert torch.equal(out[[1, 3]], x[[1, 3]])  # rows without a grammar are untouched
    word, bit = divmod(77, 32)
    assert bool(torch.isinf(out[4, 77])) != bool((int(bits[0, word]) >> bit) & 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_and_processed_batches_both_follow_the_grammar(dtype: torch.dtype) -> None:
    """A grammar row beside plain temperature rows keeps the one-pass draw (masked in the
    logits' dtype); beside a top-p row it goes through the fp32 processors. Both obey it."""
    sampler = Sampler(3, VOCAB, torch.device("cpu"), eos_token_ids=EOS, seed=0,
                      tokenizer_path=str(TINY / "tokenizer.json"))
    digits = SamplingParams(temperature=1.0, grammar=GrammarSpec("regex", "[0-9]{5}"))
    for other in (SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_p=0.5)):
        gen = torch.Generator().manual_seed(3)
        sampler.set_slot(0, digits, [5])
        sampler.set_slot(1, other, [5])
        ids: list[int] = []
        slots = torch.arange(2)
        for step in range(12):
            logits = (torch.randn(2, VOCAB, generator=gen) * 5).to(dtype)
            t = sampler.sample(logits, slots, torch.full((2,), step),
                               host_slots=[0, 1]).token_ids.tolist()[0]
            ids.append(t)
            if t in EOS:
                break
        import re
        assert re.fullmatch("[0-9]{5}", _text(ids)), ids
