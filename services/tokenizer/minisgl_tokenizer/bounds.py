"""Refusing over-long text before tokenizing all of it.

Encoding costs time and memory in proportion to the text (the embedded model's tokenizer: ~1 s and
hundreds of MB per million characters; truncation does not help, the Rust side encodes everything
first), so an 8 MiB prompt used to hold a tokenizer thread for seconds only to be refused.

Two bounds, each exact enough never to refuse a prompt that fits:
- characters: no token of the vocabulary decodes to more than `max_token_chars` characters, so a
  text longer than context x max_token_chars (x 2 for normalizers that contract characters, e.g.
  NFC composing "e" + combining accent) cannot fit. Refused without encoding anything.
- counted pieces: a longer text is encoded piece by piece (cut at whitespace, where the usual
  pre-tokenizers split anyway), stopping as soon as the pieces hold more tokens than fit plus a
  slack per cut. The work is bounded by the limit, not by the text.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

PIECE_CHARS = 32 * 1024  # texts up to this long are encoded whole, without counting first
CUT_SLACK_TOKENS = 2  # how much one cut may add to the count of the pieces (merges it broke)
NORMALIZER_FACTOR = 2  # input characters per normalized character, at most (see above)


def max_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters one token of the vocabulary stands for (an upper bound: byte-level
    vocabularies spell each byte as one character)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max((len(token) for token in vocab), default=1) or 1


@dataclass(frozen=True)
class TextBounds:
    tokenizer: Tokenizer
    context: int  # the model's context window in tokens
    token_chars: int  # max_token_chars(tokenizer)

    @classmethod
    def of(cls, tokenizer: Tokenizer, context: int) -> TextBounds:
        return cls(tokenizer, context, max_token_chars(tokenizer))

    @property
    def max_chars(self) -> int:
        """Longer texts cannot fit the context window whatever they say."""
        return self.context * self.token_chars * NORMALIZER_FACTOR

    def too_long(self, text: str, limit: int) -> str | None:
        """Why `text` certainly has more than `limit` tokens, or None when it may fit."""
        if len(text) > self.max_chars:
            return (f"the prompt has {len(text)} characters; no prompt longer than "
                    f"{self.max_chars} characters fits the context window of {self.context} "
                    f"tokens")
        if len(text) <= PIECE_CHARS:
            return None
        count, cuts, start = 0, 0, 0
        while start < len(text):
            end = _cut(text, start + PIECE_CHARS)
            count += len(self.tokenizer.encode(text[start:end], add_special_tokens=False).ids)
            if count > limit + cuts * CUT_SLACK_TOKENS:
                return (f"the prompt has more than {limit} tokens (counted up to character "
                        f"{end} of {len(text)}); the limit is {limit}")
            start, cuts = end, cuts + 1
        return None


def _cut(text: str, at: int) -> int:
    """A cut near `at`: just before the last whitespace in the preceding 1 KiB, else at `at`."""
    if at >= len(text):
        return len(text)
    space = max(text.rfind(" ", at - 1024, at), text.rfind("\n", at - 1024, at))
    return space if space > at - 1024 and space > 0 else at
