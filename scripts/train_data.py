"""Splits of the verse corpus and the text documents the tiny model is trained on.

- test (held out, shipped for the perplexity test): the last five books of the shared canon,
  1 John .. Revelation, in *both* translations, so no paraphrase of it is seen in training.
- val (early stopping): the book of Ruth, both translations.
- train: everything else, the WEB's deuterocanon included.

A plain document is one chapter: a "Book N" line, a blank line, then one verse a line.
Documents are joined with the literal "<|endoftext|>", which the tokenizer maps to its special
token, so the shipped held-out file tokenizes exactly like the training stream.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from train_corpus import Verse, read_tsv

TEST_BOOKS = frozenset({"1 John", "2 John", "3 John", "Jude", "Revelation"})
VAL_BOOKS = frozenset({"Ruth"})
EOT = "<|endoftext|>"


@dataclass
class Splits:
    train: list[Verse]
    val: list[Verse]
    test: list[Verse]


def split_verses(verses: Sequence[Verse]) -> Splits:
    s = Splits([], [], [])
    for v in verses:
        (s.test if v.book in TEST_BOOKS else s.val if v.book in VAL_BOOKS else s.train).append(v)
    return s


def chapter_documents(verses: Sequence[Verse]) -> list[str]:
    docs = []
    for (source, book, chapter), group in itertools.groupby(
        verses, key=lambda v: (v.source, v.book, v.chapter)
    ):
        head = "" if source == "txt" else f"{book} {chapter}\n\n"
        docs.append(head + "".join(v.text + "\n" for v in group))
    return docs


def join_documents(docs: Sequence[str]) -> str:
    return EOT.join(docs) + EOT


def load_plain_corpus(path: Path) -> Splits:
    """A corpus that is not our verse TSV: any UTF-8 text, paragraphs split by blank lines.

    The last 2% of paragraphs are held out, the 1% before them is the validation split.
    Each paragraph becomes a one-"verse" chapter so the rest of the pipeline is unchanged.
    """
    paras = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    n = len(paras)
    cut_val, cut_test = int(n * 0.97), int(n * 0.98)
    verses = [Verse("txt", "Text", i + 1, 1, p) for i, p in enumerate(paras)]
    return Splits(verses[:cut_val], verses[cut_val:cut_test], verses[cut_test:])


def load_splits(path: Path) -> Splits:
    if path.suffix == ".tsv":
        return split_verses(read_tsv(path))
    return load_plain_corpus(path)
