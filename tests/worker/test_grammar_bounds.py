"""Grammar compile bounds in the worker: a tiny but ruinous grammar ends its request fast (EOS
only) instead of stalling the step, a compile past its time budget does too, and the compiled-
grammar cache stays within its byte budget."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from minisgl_core.sampling import GrammarSpec
from minisgl_worker.sampling.grammar import GrammarCompiler, GrammarError, SlotGrammars

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
VOCAB = 4096
EOS = [2, 0]
# Nested counted repetition: forces ~3 MB of "a" (unbounded, the first mask takes ~1 s).
RUINOUS = GrammarSpec("regex", "((a{1000}){1000}){3}")


def _compiler(cache_bytes: int = 256 << 20) -> GrammarCompiler:
    return GrammarCompiler(str(TINY / "tokenizer.json"), VOCAB, EOS, cache_bytes)


def _allowed(grammars: SlotGrammars, slots: list[int]) -> tuple[list[set[int]], float]:
    """The tokens each row may take after one `apply`, and how long the apply took."""
    x = torch.zeros(len(slots), VOCAB)
    started = time.monotonic()
    grammars.apply(x, np.asarray(slots))
    took = time.monotonic() - started
    return [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in x], took


def test_ruinous_grammar_is_refused_by_a_bounded_compile() -> None:
    compiler = _compiler()
    started = time.monotonic()
    with pytest.raises(GrammarError, match="too many expressions"):
        compiler.matcher(RUINOUS)
    assert time.monotonic() - started < 0.5
    assert compiler.cached_bytes == 0
    # Forced text that is merely long is fine.
    assert not compiler.matcher(GrammarSpec("regex", "a{3000}")).is_error()


def test_ruinous_row_ends_at_once_and_others_keep_their_masks() -> None:
    grammars = SlotGrammars(3, VOCAB, torch.device("cpu"), _compiler())
    grammars.set_slot(0, RUINOUS, 3)
    grammars.set_slot(1, GrammarSpec("regex", "(yes|no)"), 3)
    allowed, took = _allowed(grammars, [0, 1, 2])
    assert took < 0.5, f"the step waited {took:.2f}s for a grammar"
    assert allowed[0] == set(EOS)
    assert allowed[1] and not allowed[1] & set(EOS)
    assert len(allowed[2]) == VOCAB  # no grammar: untouched


def test_compile_past_its_deadline_ends_the_request() -> None:
    compiler = _compiler()
    real = compiler.matcher

    def slow(spec: GrammarSpec):  # type: ignore[no-untyped-def]
        time.sleep(1.0)
        return real(spec)

    compiler.matcher = slow  # type: ignore[method-assign]
    grammars = SlotGrammars(1, VOCAB, torch.device("cpu"), compiler, compile_timeout=0.05)
    grammars.set_slot(0, GrammarSpec("regex", "(yes|no)"), 3)
    allowed, took = _allowed(grammars, [0])
    assert took < 0.5
    assert allowed[0] == set(EOS)


def test_cache_is_sized_in_bytes() -> None:
    one = _compiler().template_bytes("x" * 100)
    compiler = _compiler(cache_bytes=4 * one)
    specs = [GrammarSpec("regex", f"n{i:03d}-[0-9]{{2}}") for i in range(12)]
    for spec in specs:
        compiler.matcher(spec)
        assert compiler.cached_bytes <= compiler.cache_bytes
    kept = list(compiler._cache)
    assert 1 <= len(kept) <= 4 and kept[-1] == specs[-1]  # the least recently used went first
    # A template larger than the whole budget is used but not kept.
    tiny = _compiler(cache_bytes=1024)
    assert not tiny.matcher(specs[0]).is_error()
    assert tiny.cached_bytes == 0 and not tiny._cache
