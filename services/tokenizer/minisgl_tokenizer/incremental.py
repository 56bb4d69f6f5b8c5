"""Incremental decoding of one request's output tokens into text that is safe to show.

The invariant: the concatenation of every chunk `push` returns (the last with `final=True`) equals
`tokenizer.decode(all_ids)` (modulo `spaces_between_special_tokens`, below), and no chunk ends
inside a UTF-8 character. The method is the prefix/read-offset scheme of vLLM and SGLang: decode a
small window that starts a few tokens before the last emitted boundary, once without and once with
the new tokens, and emit the difference unless the window text ends in U+FFFD (an incomplete
character: hold it back). Decoders that treat the first token of a decode specially (SentencePiece's
leading-space strip) see the same first token in both decodes, so the difference is exact. Each step
costs O(window), not O(length).

The steady state runs in Rust through `tokenizers.decoders.DecodeStream`, which implements the same
scheme; the Python window decode is used for the final flush, for locating the token that completed
a stop string, and as the fallback if a stream errors or the installed `tokenizers` has no
DecodeStream.

`spaces_between_special_tokens` (only meaningful when special tokens are kept): the output is the
decoded runs of ordinary tokens and the special tokens' text, joined by single spaces, the way
transformers' Python tokenizers join added tokens. With the flag off, or when special tokens are
skipped, the output is exactly `tokenizer.decode(ids, skip_special_tokens=...)`. Only tokens marked
special split runs: non-special added tokens (like `<think>`) decode in place, as fast tokenizers
do.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

try:  # tokenizers >= 0.22: a Rust stream that also takes a list of ids per step
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers take the Python window path
    DecodeStream = None  # type: ignore[assignment,misc]  # the class, or None without it

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 4  # tokens of already-emitted context at the start of every window decode
_TRIM_AT = 64  # drop consumed ids from the window once it holds this many
_UNKNOWN_ID = 2**32 - 1  # decodes to nothing; stands in for a negative id, which tokenizers rejects


class IncrementalDecoder:
    """One request's decoding state. `pieces` describes the last chunk for stop-string locating."""

    __slots__ = (
        "tok", "skip", "special_text", "segmented", "stream", "ids", "base", "n", "emitted_upto",
        "seg_start", "segments", "pieces",
    )

    def __init__(
        self,
        tok: Tokenizer,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        special_text: dict[int, str] | None = None,
        use_stream: bool = True,
    ) -> None:
        self.tok = tok
        self.skip = skip_special_tokens
        self.special_text = special_text or {}
        self.segmented = (not skip_special_tokens) and spaces_between_special_tokens and bool(
            self.special_text)
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens) if (
            use_stream and DecodeStream is not None) else None
        self.ids: list[int] = []  # window of ids; ids[0] is token number `base` of the request
        self.base = 0
        self.n = 0  # tokens pushed so far
        self.emitted_upto = 0  # tokens [0, emitted_upto) are fully reflected in emitted text
        self.seg_start = 0  # first token of the current run (segmented mode); windows start here
        self.segments = 0  # runs and special tokens emitted so far (segmented mode)
        # (chars, first token, end token, run start) for each part of the last chunk, in order
        self.pieces: list[tuple[int, int, int, int]] = []

    # -- public ---------------------------------------------------------------------------------

    def push(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the text that became safe to show (maybe ""). `final`: the request
        ends with these tokens, so everything still held back comes out too."""
        self.pieces = []
        if type(new_ids) is not list:
            # A protobuf repeated field (the gRPC path): every len/index/min/extend on it costs
            # several times what it does on a list, so read it once. Most updates are one token.
            new_ids = [new_ids[0]] if len(new_ids) == 1 else list(new_ids)
        if not new_ids:
            return self._flush_run() if final else ""
        if min(new_ids) < 0:
            new_ids = [i if i >= 0 else _UNKNOWN_ID for i in new_ids]
        if not self.segmented or self.special_text.keys().isdisjoint(new_ids):
            text = self._run(new_ids)
            return text + self._flush_run() if final and self.emitted_upto < self.n else text
        out: list[str] = []
        run: list[int] = []
        for tid in new_ids:
            if tid not in self.special_text:
                run.append(tid)
                continue
            if run:
                out.append(self._run(run))
                run = []
            out.append(self._special(tid))
        if run:
            out.append(self._run(run))
        if final:
            out.append(self._flush_run())
        return "".join(out)

    def locate(self, chars: int) -> int:
        """How many tokens it took to produce the first `chars` chars of the last chunk (>= 1)."""
        for length, first, end, run_start in self.pieces:
            if chars <= length:
                if end - first > 1 and chars > 0:
                    return self._refine(max(run_start, first - CONTEXT_TOKENS), first, end, chars)
                return end
            chars -= length
        return self.n

    # -- internals ------------------------------------------------------------------------------

    def _run(self, run: Sequence[int]) -> str:
        """Ordinary tokens (or anything, when not segmented) through the stream. Hot path."""
        sep = ""
        if self.segmented and self.seg_start == self.n:  # first token of a new run
            if self.segments:
                sep = " "
                self.pieces.append((1, self.n, self.n + 1, self.n))
            self.segments += 1
        first = self.emitted_upto
        self.ids.extend(run)
        self.n += len(run)
        text = None
        if self.stream is not None:
            try:
                text = self.stream.step(self.tok, list(run) if len(run) > 1 else run[0])
            except Exception:  # a decoder the stream cannot follow: the Python window from now on
                self.stream = None
                text = self._window_step()
        else:
            text = self._window_step()
        if text:
            self.pieces.append((len(text), first, self.n, self.seg_start))
            self.emitted_upto = self.n
            if self.n - self.base > _TRIM_AT:
                self._trim(first)
            return sep + text if sep else text
        return sep

    def _window_step(self) -> str | None:
        """The stream's step in Python: the window text minus its already-emitted prefix."""
        start = self._window_start()
        prefix = self._decode(start, self.emitted_upto)
        full = self._decode(start, self.n)
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            return full[len(prefix):]
        return None

    def _special(self, tid: int) -> str:
        """A kept special token in segmented mode: close the current run, emit its own segment."""
        out = self._flush_run()
        text = (" " if self.segments else "") + self.special_text[tid]
        self.segments += 1
        self.ids.append(tid)
        self.n += 1
        self.emitted_upto = self.n
        self.seg_start = self.n  # the next ordinary token opens a new run, decoded on its own
        if self.stream is not None:
            self.stream = DecodeStream(skip_special_tokens=self.skip)
        self.pieces.append((len(text), self.n - 1, self.n, self.n - 1))
        return out + text

    def _flush_run(self) -> str:
        """Everything held back in the current run, decoded as final."""
        if self.emitted_upto >= self.n:
            return ""
        start, first = self._window_start(), self.emitted_upto
        text = self._decode(start, self.n)[len(self._decode(start, first)):]
        self.pieces.append((len(text), first, self.n, self.seg_start))
        self.emitted_upto = self.n
        return text

    def _window_start(self) -> int:
        return max(self.seg_start, self.emitted_upto - CONTEXT_TOKENS)

    def _refine(self, start: int, first: int, end: int, chars: int) -> int:
        """Smallest token count in (first, end] whose stable text already has `chars` new chars."""
        if start < self.base:  # cannot happen: _trim keeps the context of the last chunk
            return end
        prefix_len = len(self._decode(start, first))
        for upto in range(first + 1, end):
            text = self._decode(start, upto).rstrip(REPLACEMENT)
            if len(text) - prefix_len >= chars:
                return upto
        return end

    def _decode(self, start: int, end: int) -> str:
        if end <= start:
            return ""
        return self.tok.decode(self.ids[start - self.base:end - self.base],
                               skip_special_tokens=self.skip)

    def _trim(self, first: int) -> None:
        """Drop ids no window can need again: keep context before `first`, the start of the
        chunk just emitted, which locate() may still have to decode."""
        cut = first - CONTEXT_TOKENS - self.base  # windows never start earlier than this
        if cut > 0:
            del self.ids[:cut]
            self.base += cut
