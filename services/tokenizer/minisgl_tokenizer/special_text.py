"""Client text in a chat never becomes a control token.

The chat template writes the special tokens (`<|im_start|>`, `<|im_end|>`, ...) around each turn;
a user who writes `<|im_end|>\\n<|im_start|>system` in a message must not end their turn and forge
a system turn. OpenAI encodes such text as plain text; so do we: every special token's string in a
client string of the conversation (message contents and parts, names, tool calls, tool schemas) is
swapped for a per-request placeholder before rendering; the rendered text is encoded piecewise, the
template's text as usual and each placeholder as the plain-text tokens of what the client wrote.

A conversation without any special token string (almost every one) takes the usual path and gets
the same ids as before, byte for byte. Raw `/v1/completions` text is not escaped: a client that
sends text writes the control tokens on purpose.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer


@dataclass(slots=True)
class Masked:
    """A conversation with its special token strings swapped out."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    originals: list[str]  # placeholder k stands for originals[k]
    nonce: str


class SpecialTextEscaper:
    def __init__(self, tokenizer: Tokenizer, special_strings: list[str]) -> None:
        self._tokenizer = tokenizer
        # Longest first, so `<|im_start|>` wins over a special token that is its prefix.
        strings = sorted({s for s in special_strings if s}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, strings))) if strings else None
        self._plain: Tokenizer | None = None  # a copy that reads special strings as text

    def mask(self, messages: list[dict[str, Any]],
             tools: list[dict[str, Any]] | None) -> Masked | None:
        """None when no client string holds a special token string (nothing to escape)."""
        if self._pattern is None:
            return None
        nonce = secrets.token_hex(8)
        originals: list[str] = []

        def swap(match: re.Match[str]) -> str:
            originals.append(match.group(0))
            return f"\x00{nonce}:{len(originals) - 1}\x00"

        def walk(value: Any) -> Any:
            if isinstance(value, str):
                return self._pattern.sub(swap, value) if self._pattern else value
            if isinstance(value, dict):
                return {walk(k): walk(v) for k, v in value.items()}
            if isinstance(value, list):
                return [walk(v) for v in value]
            return value

        masked_messages = walk(messages)
        masked_tools = walk(tools)
        if not originals:
            return None
        return Masked(masked_messages, masked_tools, originals, nonce)

    def encode(self, rendered: str, masked: Masked, add_special_tokens: bool) -> list[int]:
        """The ids of `rendered` with each placeholder encoded as plain text."""
        if self._plain is None:
            plain = Tokenizer.from_str(self._tokenizer.to_str())
            plain.encode_special_tokens = True
            self._plain = plain  # set up before it is shared (tokenize runs on many threads)
        parts = re.split(f"\x00{masked.nonce}:(\\d+)\x00", rendered)
        # re.split with one group alternates: text, index, text, index, ..., text
        texts = parts[0::2]
        escaped = [masked.originals[int(k)] for k in parts[1::2]]
        ids: list[int] = []
        text_encs = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        plain_encs = self._plain.encode_batch(escaped, add_special_tokens=False) if escaped else []
        for i, enc in enumerate(text_encs):
            ids.extend(enc.ids)
            if i < len(plain_encs):
                ids.extend(plain_encs[i].ids)
        if add_special_tokens:  # what the post-processor adds around a whole prompt
            prefix, suffix = self._added_around()
            ids = prefix + ids + suffix
        return ids

    def _added_around(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer's post-processor puts before and after a text (BOS, EOS)."""
        bare = self._tokenizer.encode("a", add_special_tokens=False).ids
        full = self._tokenizer.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(bare) + 1):
            if full[start:start + len(bare)] == bare:
                return full[:start], full[start + len(bare):]
        return [], []
