"""The draw's Gumbel noise is finite for every hash: a masked (-inf) logit can never win.

With 24 hash bits, the top bit pattern rounded to u = 1.0, noise +inf: the token won whatever its
logit, and a grammar-masked token (-inf + inf = NaN, which torch's argmax picks) was emitted. The
case below is a real one: seed 9, position 299, token 3445 of the tiny model's vocabulary, a JSON
schema reply that broke its grammar at that position (issue 55, point 1)."""

from __future__ import annotations

import pytest
import torch
from minisgl_worker.sampling import ops

VOCAB, SEED, POSITION, TOP_TOKEN = 4096, 9, 299, 3445


def test_uniform_is_strictly_inside_the_unit_interval() -> None:
    bits = torch.tensor([0, 1, (1 << 32) - 1, (1 << 31), (1 << 24) - 1], dtype=torch.int64)
    u = ops.uniform_from_bits(bits)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def test_the_case_hits_the_top_bit_pattern() -> None:
    """The fixed case really is the extreme hash (else the tests below prove nothing)."""
    keys = ops.row_keys(torch.tensor([SEED]), torch.tensor([POSITION]))
    bits = ops.hash32(keys[:, None] ^ ops.token_hashes(VOCAB, torch.device("cpu"))[None, :])
    assert int(bits[0, TOP_TOKEN]) >> 8 == (1 << 24) - 1


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("temperature", [None, 0.8])
def test_masked_token_never_wins(use_triton: bool, temperature: float | None) -> None:
    allowed = 19
    x = torch.full((1, VOCAB), float("-inf"))
    x[0, allowed] = 0.0
    temps = None if temperature is None else torch.tensor([temperature])
    got = ops.gumbel_argmax(x, torch.tensor([SEED]), torch.tensor([POSITION]),
                            ops.token_hashes(VOCAB, x.device), temps=temps, use_triton=use_triton)
    assert int(got[0]) == allowed


@pytest.mark.parametrize("use_triton", [False, True])
def test_an_unlikely_token_is_not_forced(use_triton: bool) -> None:
    """The top hash gives a large but finite boost: a token 100 nats below another loses."""
    x = torch.full((1, VOCAB), -100.0)
    x[0, 7] = 0.0
    got = ops.gumbel_argmax(x, torch.tensor([SEED]), torch.tensor([POSITION]),
                            ops.token_hashes(VOCAB, x.device), use_triton=use_triton)
    assert int(got[0]) == 7
