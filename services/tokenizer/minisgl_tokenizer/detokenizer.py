"""Many requests' token streams to text deltas, one batch of updates per scheduler step.

One `Detokenizer` holds the state of the requests of one caller (one gRPC stream from one gateway):
an `IncrementalDecoder` and, when the request has stop strings, a `StopMatcher`. A request's state
is created by its first update (which carries its stop conditions) and forgotten on `finished`.
After a stop string matched, the request keeps only a tombstone so that tokens still in flight
produce no text; tombstones are forgotten on `finished` too, or, if that never comes (the caller
aborted upstream and dropped the request), once `max_tombstones` newer ones have piled up.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from minisgl_tokenizer.incremental import IncrementalDecoder
from minisgl_tokenizer.stop_strings import StopMatch, StopMatcher


@dataclass(slots=True)
class StopConditions:
    """Mirrors `minisgl.v1.StopConditions` (defaults as documented there)."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


DEFAULT_STOP = StopConditions()


@dataclass(slots=True)
class DetokenizeUpdate:
    rid: int
    token_ids: Sequence[int] = ()  # new tokens since this request's last update
    stop: StopConditions | None = None  # read on the request's first update only
    finished: bool = False  # flush and forget the request


@dataclass(slots=True)
class TextDelta:
    rid: int
    text: str = ""
    stopped: bool = False  # a stop string matched: the caller aborts the request upstream
    matched_stop: str = ""
    num_tokens: int = 0  # tokens up to and including the one that completed the match


@dataclass(slots=True)
class _Request:
    decoder: IncrementalDecoder
    matcher: StopMatcher | None


@dataclass
class DetokenizerStats:
    tokens: int = 0
    stops: int = 0
    ended: int = 0  # requests forgotten: finished, or stopped by a stop string


@dataclass
class Detokenizer:
    tokenizer: Tokenizer
    special_text: dict[int, str] = field(default_factory=dict)  # special token id -> its text
    max_tombstones: int = 4096
    stats: DetokenizerStats = field(default_factory=DetokenizerStats)

    def __post_init__(self) -> None:
        self._requests: dict[int, _Request] = {}
        self._tombstones: OrderedDict[int, None] = OrderedDict()

    @property
    def active(self) -> int:
        return len(self._requests)

    def step(self, updates: Iterable[DetokenizeUpdate]) -> list[TextDelta]:
        """One delta per update, in order."""
        update = self.update
        return [update(u.rid, u.token_ids, u.finished, u.stop) for u in updates]

    def update(self, rid: int, token_ids: Sequence[int], finished: bool = False,
               stop: StopConditions | None = None) -> TextDelta:
        """One request's update (what `step` does for each); `stop` is read on the first only."""
        self.stats.tokens += len(token_ids)
        req = self._requests.get(rid)
        if req is None:
            if rid in self._tombstones:  # stopped earlier: in-flight tokens produce nothing
                if finished:
                    del self._tombstones[rid]
                return TextDelta(rid)
            req = self._requests[rid] = self._start(stop or DEFAULT_STOP)
        text = req.decoder.push(token_ids, final=finished)
        matcher = req.matcher
        if matcher is None:
            if finished:
                self._end(rid)
            return TextDelta(rid, text)
        safe, match = matcher.feed(text)
        if match is not None:
            return self._stopped(rid, req, safe, match, finished)
        if finished:
            safe += matcher.flush()
            self._end(rid)
        return TextDelta(rid, safe)

    def forget(self, rid: int) -> None:
        self._requests.pop(rid, None)
        self._tombstones.pop(rid, None)

    def _stopped(self, rid: int, req: _Request, text: str, match: StopMatch,
                 finished: bool) -> TextDelta:
        num_tokens = req.decoder.locate(match.chars_in_chunk)
        self.stats.stops += 1
        self._end(rid)
        if not finished:
            self._tombstones[rid] = None
            while len(self._tombstones) > self.max_tombstones:
                self._tombstones.popitem(last=False)
        return TextDelta(rid, text, True, match.stop, num_tokens)

    def _start(self, stop: StopConditions) -> _Request:
        decoder = IncrementalDecoder(
            self.tokenizer,
            skip_special_tokens=stop.skip_special_tokens,
            spaces_between_special_tokens=stop.spaces_between_special_tokens,
            special_text=self.special_text,
        )
        matcher = StopMatcher(stop.stop, stop.include_stop_str_in_output) if stop.stop else None
        return _Request(decoder, matcher or None)

    def _end(self, rid: int) -> None:
        self._requests.pop(rid, None)
        self.stats.ended += 1
