"""Stop strings over a stream of text chunks.

Matching happens on text, after incremental decoding, so a stop string split over any number of
tokens (and chunks) is found. The first stop string to *complete* wins (ties: the one that starts
first); the output ends right before it, or right after it with `include`. While the text so far
ends with something that could grow into a stop string, that suffix is held back, so the caller
never shows text that a later chunk turns into (part of) a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StopMatch:
    stop: str
    chars_in_chunk: int  # chars of the chunk that the match needed (>= 1): locates the token


class StopMatcher:
    __slots__ = ("stops", "include", "keep", "recent", "held")

    def __init__(self, stops: tuple[str, ...] | list[str], include: bool = False) -> None:
        # Empty strings would match everywhere; duplicates change nothing.
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self.include = include
        # Enough already-seen text to find a stop string that began in an earlier chunk.
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.recent = ""  # the last `keep` chars seen (emitted or held)
        self.held = 0  # chars at the end of `recent` not emitted yet

    def __bool__(self) -> bool:
        return bool(self.stops)

    def feed(self, chunk: str) -> tuple[str, StopMatch | None]:
        """Return (text safe to emit now, the match if a stop string completed in this chunk)."""
        if not chunk:
            return "", None
        buf = self.recent + chunk
        emit_from = len(self.recent) - self.held  # buf[emit_from:] has not been emitted
        match = self._first_match(buf, len(self.recent))
        if match is not None:
            start, end, stop = match
            cut = end if self.include else start
            found = StopMatch(stop, end - len(self.recent))
            self.recent, self.held = "", 0
            return buf[emit_from:max(cut, emit_from)], found
        hold = 0 if self.include else self._hold_length(buf, self.held + len(chunk))
        out = buf[emit_from:len(buf) - hold]
        self.recent = buf[-self.keep:] if self.keep else ""
        self.held = hold
        return out, None

    def flush(self) -> str:
        """The stream ended without a match: the held-back text is ordinary text after all."""
        out = self.recent[len(self.recent) - self.held:] if self.held else ""
        self.held = 0
        return out

    def _first_match(self, buf: str, chunk_start: int) -> tuple[int, int, str] | None:
        """The earliest-ending occurrence that ends inside the chunk (earlier ones ended before)."""
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            # An occurrence ending in the chunk starts at or after chunk_start - len(stop) + 1.
            pos = buf.find(stop, max(0, chunk_start - len(stop) + 1))
            if pos < 0:
                continue
            end = pos + len(stop)
            if best is None or end < best[1] or (end == best[1] and pos < best[0]):
                best = (pos, end, stop)
        return best

    def _hold_length(self, buf: str, limit: int) -> int:
        """Length of the longest suffix of buf (at most `limit`) that is a proper prefix of a stop
        string. Only positions holding a stop string's first character are tried."""
        size = len(buf)
        lowest = size - min(limit, self.keep, size)
        best = 0
        for stop in self.stops:
            first = stop[0]
            i = buf.find(first, max(lowest, size - len(stop) + 1))
            while i >= 0 and size - i > best:
                if stop.startswith(buf[i:]):
                    best = size - i  # the earliest position is the longest suffix for this stop
                    break
                i = buf.find(first, i + 1)
        return best
