"""Held-out windows of the embedded model's corpus, shared by the model tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .perplexity import NUM_WINDOWS, WINDOW

HELDOUT = Path(__file__).parent / "data" / "heldout.txt"


@pytest.fixture(scope="session")
def heldout_ids(tiny_model_path: Path) -> list[int]:
    """The held-out slice (1 John..Revelation, both translations) through the shipped tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))
    return tok.encode(HELDOUT.read_text(encoding="utf-8"), add_special_tokens=False).ids


@pytest.fixture(scope="session")
def heldout_windows(heldout_ids: list[int]) -> torch.Tensor:
    """NUM_WINDOWS windows of WINDOW + 1 tokens spread evenly over the slice: inputs + targets."""
    ids = torch.tensor(heldout_ids)
    starts = torch.linspace(0, len(ids) - WINDOW - 1, NUM_WINDOWS).long()
    return torch.stack([ids[s : s + WINDOW + 1] for s in starts.tolist()])
