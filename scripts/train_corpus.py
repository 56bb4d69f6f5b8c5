"""Build the training corpus of the embedded model from two public-domain English Bibles.

Both come from Debian packages, so the corpus can be rebuilt offline from a package mirror:

    apt-get install bible-kjv sword-text-web libsword-utils
    python scripts/train_corpus.py --out .train/corpus.tsv

- King James Version (1611): `bible-kjv-text` (data) + `bible-kjv` (the `bible` reader). The KJV
  text is out of copyright (Debian's copyright file says so); the reader is GPL-2+ but we only
  run it to print the text.
- World English Bible (2015 edition, with deuterocanon): `sword-text-web` (a SWORD module),
  dumped by `mod2imp` from `libsword-utils`. The WEB is dedicated to the public domain
  (Debian's copyright file: "License: public-domain").

The output is a TSV, one verse a line: source, book, chapter, verse, text. Book names follow
the KJV reader's spelling ("1 Samuel", "Revelation"), so the two translations line up verse by
verse; the training script pairs them for its "say it in modern English" chat examples.
"""

from __future__ import annotations

import argparse
import csv
import html
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The 66 books both translations share, in canonical order; the held-out slice is taken
# from the end of this list so that neither translation of it is seen in training.
CANON: tuple[str, ...] = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah",
    "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians",
    "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians", "1 Thessalonians",
    "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James",
    "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation",
)  # fmt: skip

WEB_MODULE = "engWEB2015eb"


@dataclass(frozen=True)
class Verse:
    source: str  # "kjv" or "web"
    book: str
    chapter: int
    verse: int
    text: str


def kjv_verses() -> list[Verse]:
    """Every KJV verse, printed by the `bible` reader of Debian's bible-kjv."""
    out = _run(["bible", "-l0", "Gen1:1-Rev22:21"])
    verses: list[Verse] = []
    book, chapter = "", 0
    for line in out.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):  # a "Book N" header starts in column 0
            book, _, num = line.strip().rpartition(" ")
            chapter = int(num)
            continue
        num, _, text = line.strip().partition(" ")
        verses.append(Verse("kjv", book, chapter, int(num), _clean(text)))
    return verses


_WEB_BOOKS = {"Revelation of John": "Revelation"}
_ROMAN = {"I": "1", "II": "2", "III": "3", "IV": "4"}


def web_book_name(name: str) -> str:
    """SWORD spells "II Kings"; the KJV reader spells "2 Kings"."""
    head, _, rest = name.partition(" ")
    if head in _ROMAN and rest:
        return f"{_ROMAN[head]} {rest}"
    return _WEB_BOOKS.get(name, name)


_NOTE = re.compile(r"<note\b.*?</note>", re.S)
_DROP = re.compile(r"<(title|catchWord|rdg)\b.*?</\1>", re.S)
_TAG = re.compile(r"<[^>]*>")


def osis_to_text(osis: str) -> str:
    """Plain text of one OSIS verse entry: footnotes and headings dropped, words kept apart.

    A footnote sits between two words with no space around it ("God<note>..</note>created"),
    so a removed block becomes a space when it separated two word characters.
    """
    text = _NOTE.sub("\x00", osis)
    text = _DROP.sub("\x00", text)
    text = re.sub(r"<(?:l|lg|lb|div|milestone|item|list)\b[^>]*>", "\x00", text)
    text = _TAG.sub("", text)  # inline tags: <w>, <q>, <name>, <seg> ...
    text = re.sub(r"(\w)\x00+(?=\w)", r"\1 ", text)
    text = text.replace("\x00", " ")
    return _clean(html.unescape(text))


def web_verses() -> list[Verse]:
    """Every WEB verse (66 books + deuterocanon), dumped from the SWORD module by mod2imp."""
    out = _run(["mod2imp", WEB_MODULE])
    verses: list[Verse] = []
    for key, body in re.findall(r"^\$\$\$(.*)\n((?:(?!\$\$\$).*\n?)*)", out, re.M):
        m = re.fullmatch(r"(.+) (\d+):(\d+)", key.strip())
        if not m or int(m[2]) == 0 or int(m[3]) == 0:  # module/book/chapter headings
            continue
        text = osis_to_text(body)
        if text:
            verses.append(Verse("web", web_book_name(m[1]), int(m[2]), int(m[3]), text))
    return verses


def _clean(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    except FileNotFoundError as exc:
        raise SystemExit(
            f"{cmd[0]} not found: apt-get install bible-kjv sword-text-web libsword-utils"
        ) from exc


def write_tsv(verses: list[Verse], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n", quoting=csv.QUOTE_NONE)
        for v in verses:
            w.writerow([v.source, v.book, v.chapter, v.verse, v.text.replace("\t", " ")])


def read_tsv(path: Path) -> list[Verse]:
    verses = []
    with path.open(encoding="utf-8") as f:
        for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            verses.append(Verse(row[0], row[1], int(row[2]), int(row[3]), row[4]))
    return verses


def build_corpus() -> list[Verse]:
    kjv, web = kjv_verses(), web_verses()
    books = {v.book for v in kjv}
    if books != set(CANON):
        raise SystemExit(f"unexpected KJV books: {sorted(books ^ set(CANON))}")
    # The last WEB verse carries the module's glossary as trailing text: cut it off.
    web = [_strip_glossary(v) for v in web]
    return kjv + web


def _strip_glossary(v: Verse) -> Verse:
    cut = v.text.find("The following words used in the World English Bible")
    if cut <= 0:
        return v
    return Verse(v.source, v.book, v.chapter, v.verse, v.text[:cut].strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    verses = build_corpus()
    write_tsv(verses, args.out)
    n_chars = sum(len(v.text) for v in verses)
    print(f"wrote {len(verses)} verses, {n_chars} characters to {args.out}")


if __name__ == "__main__":
    main()
