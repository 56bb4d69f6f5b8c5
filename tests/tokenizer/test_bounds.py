"""Over-long text is refused before it is encoded whole, and nothing that fits is refused."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from minisgl_tokenizer.bounds import PIECE_CHARS, TextBounds
from minisgl_tokenizer.model_files import ModelTokenizer
from minisgl_tokenizer.prompt import ErrorCode, PromptTokenizer, TextPrompt

from .conftest import CORPUS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wide() -> ModelTokenizer:
    """The embedded model's tokenizer with a 1M-token context: long texts fit."""
    return ModelTokenizer.load(ROOT / "models" / "tiny", max_model_len=1_000_000)


def _text(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < chars:
        part = rng.choice(CORPUS) + rng.choice([" ", "\n", "  ", ""])
        parts.append(part)
        size += len(part)
    return "".join(parts)[:chars]


@pytest.mark.parametrize("seed", range(4))
def test_counting_by_pieces_matches_the_whole(wide: ModelTokenizer, seed: int) -> None:
    text = _text(4 * PIECE_CHARS + 123, seed)
    assert len(text) > PIECE_CHARS
    count = len(wide.tokenizer.encode(text, add_special_tokens=False).ids)
    bounds = TextBounds.of(wide.tokenizer, wide.max_model_len)
    assert bounds.too_long(text, count) is None  # exactly fits: never refused
    assert bounds.too_long(text, count + 5) is None
    assert bounds.too_long(text, count // 2) is not None  # far past: refused
    prompts = PromptTokenizer(wide)
    (fits,) = prompts.tokenize([TextPrompt(text, add_special_tokens=False)], count)
    assert fits.error is None and len(fits.token_ids) == count
    (over,) = prompts.tokenize([TextPrompt(text, add_special_tokens=False)], count // 2)
    assert over.error is not None and over.error.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED


def test_character_bound_refuses_without_encoding(tiny_model_path: Path) -> None:
    model = ModelTokenizer.load(tiny_model_path)
    bounds = TextBounds.of(model.tokenizer, model.max_model_len)
    # No token of the vocabulary is longer than token_chars, so the bound is never too tight.
    assert all(len(t) <= bounds.token_chars for t in model.tokenizer.get_vocab())
    (result,) = PromptTokenizer(model).tokenize([TextPrompt("a" * (bounds.max_chars + 1))])
    assert result.error is not None and result.error.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert "characters" in result.error.message
