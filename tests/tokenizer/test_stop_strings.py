"""Stop strings across token boundaries, through the Detokenizer (and the matcher on its own)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from minisgl_tokenizer import Detokenizer, DetokenizeUpdate, StopConditions, StopMatcher
from tokenizers import Tokenizer

from .conftest import CHATML_SPECIALS, train_bpe


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe(CHATML_SPECIALS)


def char_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per character (ASCII: the byte-level alphabet has each as a token)."""
    ids = [tok.token_to_id(c) for c in text.replace(" ", "Ġ").replace("\n", "Ċ")]
    assert None not in ids
    return ids


def run(tok: Tokenizer, ids: list[int], stop: StopConditions, sizes: int | list[int] = 1,
        finish: bool = True) -> tuple[str, list]:
    """Feed ids in updates of `sizes` tokens; return the text and every delta."""
    detok = Detokenizer(tok, {i: t.content for i, t in tok.get_added_tokens_decoder().items()
                              if t.special})
    deltas, text, pos, first = [], "", 0, True
    cuts = sizes if isinstance(sizes, list) else [sizes] * len(ids)
    for size in cuts:
        if pos >= len(ids):
            break
        update = DetokenizeUpdate(7, ids[pos:pos + size], stop if first else None)
        pos += size
        first = False
        (delta,) = detok.step([update])
        deltas.append(delta)
        text += delta.text
        for s in stop.stop:  # never shown, not even for a moment
            assert stop.include_stop_str_in_output or s not in text
    if finish:
        (delta,) = detok.step([DetokenizeUpdate(7, [], None, finished=True)])
        deltas.append(delta)
        text += delta.text
    assert detok.active == 0 or not finish
    return text, deltas


def test_stop_string_split_over_three_tokens(tok: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    ids = tok.encode(text).ids
    pieces = [tok.decode([i]) for i in ids]
    # A stop string that starts inside one token, covers the next, and ends inside the third.
    k = next(k for k in range(len(pieces) - 2)
             if len(pieces[k]) >= 2 and len(pieces[k + 2]) >= 2)
    stop = pieces[k][-1] + pieces[k + 1] + pieces[k + 2][:1]
    before = "".join(pieces[:k]) + pieces[k][:-1]
    assert text.find(stop) == len(before)
    out, deltas = run(tok, ids, StopConditions(stop=(stop,)))
    assert out == before
    stopped = [d for d in deltas if d.stopped]
    assert len(stopped) == 1 and stopped[0].matched_stop == stop
    assert stopped[0].num_tokens == k + 3
    assert all(d.text == "" for d in deltas[deltas.index(stopped[0]) + 1:])


def test_one_char_per_token_and_include_stop(tok: Tokenizer) -> None:
    ids = char_ids(tok, "say hello world and more")
    out, deltas = run(tok, ids, StopConditions(stop=("lo wor",)))
    assert out == "say hel"
    assert deltas[-2].stopped or any(d.stopped for d in deltas)
    (hit,) = [d for d in deltas if d.stopped]
    assert hit.num_tokens == len("say hello wor")
    out, deltas = run(tok, ids, StopConditions(stop=("lo wor",), include_stop_str_in_output=True))
    assert out == "say hello wor"
    (hit,) = [d for d in deltas if d.stopped]
    assert hit.num_tokens == len("say hello wor")


@pytest.mark.parametrize("sizes", [1, 3, 100])
def test_multiple_stop_strings_first_to_complete_wins(tok: Tokenizer, sizes: int) -> None:
    ids = char_ids(tok, "abc xyzzy fin abcd")
    out, deltas = run(tok, ids, StopConditions(stop=("fin", "zzy", "nomatch")), sizes)
    assert out == "abc xy"
    (hit,) = [d for d in deltas if d.stopped]
    assert hit.matched_stop == "zzy" and hit.num_tokens == len("abc xyzzy")
    # Overlapping: "bcd" completes before "abcde" could.
    out, deltas = run(tok, char_ids(tok, "xxabcdef"), StopConditions(stop=("abcde", "bcd")), sizes)
    assert out == "xxa"
    assert [d.matched_stop for d in deltas if d.stopped] == ["bcd"]


@pytest.mark.parametrize("sizes", [1, 2, 5])
def test_overlapping_prefixes_are_held_then_released(tok: Tokenizer, sizes: int) -> None:
    # "aab" only matches at the second "a": a naive matcher that restarts after "aa" misses it.
    out, deltas = run(tok, char_ids(tok, "xaaab tail"), StopConditions(stop=("aab",)), sizes)
    assert out == "xa"
    assert [d.num_tokens for d in deltas if d.stopped] == [len("xaaab")]
    # A prefix that never completes is shown in the end, and nothing is lost.
    out, deltas = run(tok, char_ids(tok, "one abcx two ab"), StopConditions(stop=("abcd",)), sizes)
    assert out == "one abcx two ab"
    assert not any(d.stopped for d in deltas)


def test_held_prefix_is_not_shown_before_it_resolves(tok: Tokenizer) -> None:
    ids = char_ids(tok, "hi abc")
    _, deltas = run(tok, ids, StopConditions(stop=("abcd",)), finish=False)
    assert "".join(d.text for d in deltas) == "hi "


def test_multi_token_update_reports_the_completing_token(tok: Tokenizer) -> None:
    ids = char_ids(tok, "0123456789")
    out, deltas = run(tok, ids, StopConditions(stop=("34",)), sizes=[2, 6, 2])
    assert out == "012"
    (hit,) = [d for d in deltas if d.stopped]
    assert hit.num_tokens == 5  # "0","1" | "2","3","4": the fifth token completed "34"


def test_stop_inside_multibyte_characters(tok: Tokenizer) -> None:
    text = "你好世界🎉再见"
    ids = tok.encode(text).ids
    assert len(ids) > len(text)  # several byte tokens per character
    for stop, want in (("世界", "你好"), ("🎉", "你好世界"), ("好世", "你")):
        out, deltas = run(tok, ids, StopConditions(stop=(stop,)))
        assert out == want
        (hit,) = [d for d in deltas if d.stopped]
        # The token that completed the match: the shortest prefix of ids that decodes to it.
        need = next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))
        assert hit.num_tokens == need


def test_stop_on_special_token_text_when_kept(tok: Tokenizer) -> None:
    end = tok.token_to_id("<|im_end|>")
    ids = char_ids(tok, "done") + [end] + char_ids(tok, "junk")
    out, _ = run(tok, ids, StopConditions(stop=("<|im_end|>",), skip_special_tokens=False,
                                          spaces_between_special_tokens=False))
    assert out == "done"
    out, _ = run(tok, ids, StopConditions(stop=("<|im_end|>",)))  # skipped: no match
    assert out == "donejunk"


def test_updates_after_stop_produce_nothing_and_state_is_freed(tok: Tokenizer) -> None:
    detok = Detokenizer(tok)
    ids = char_ids(tok, "abXYcd")
    (d,) = detok.step([DetokenizeUpdate(1, ids[:4], StopConditions(stop=("XY",)))])
    assert d.stopped and d.text == "ab" and d.num_tokens == 4
    (d,) = detok.step([DetokenizeUpdate(1, ids[4:])])
    assert d.text == "" and not d.stopped
    assert detok.active == 0
    (d,) = detok.step([DetokenizeUpdate(1, [], finished=True)])
    assert d.text == ""
    # The rid is free again: a new request with the same id starts clean.
    (d,) = detok.step([DetokenizeUpdate(1, ids[4:], None, finished=True)])
    assert d.text == "cd"


def test_matcher_alone() -> None:
    m = StopMatcher(["END", ""], include=False)
    out = [m.feed(c) for c in ["xx E", "N", "D yy"]]
    assert [o[0] for o in out] == ["xx ", "", ""]
    assert out[2][1] is not None and out[2][1].stop == "END" and out[2][1].chars_in_chunk == 1
    m = StopMatcher(["END"])
    assert m.feed("abc EN")[0] == "abc " and m.flush() == "EN"
    assert not StopMatcher(["", ""])


def expected(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Reference: the stop string that completes first in the full text (ties: starts first)."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, start, stop = min(hits)
    return text[:end if include else start], stop


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text("ab c", max_size=30), stops=st.lists(st.text("ab c", min_size=1, max_size=4),
                                                          min_size=1, max_size=3),
       include=st.booleans(), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=30))
def test_stop_strings_match_a_simple_reference(tok: Tokenizer, text: str, stops: list[str],
                                               include: bool, sizes: list[int]) -> None:
    ids = char_ids(tok, text)
    cuts = sizes * (len(ids) // len(sizes) + 1)
    conditions = StopConditions(stop=tuple(stops), include_stop_str_in_output=include)
    out, deltas = run(tok, ids, conditions, cuts)
    want, stop = expected(text, stops, include)
    assert out == want
    hits = [d for d in deltas if d.stopped]
    if stop is None:
        assert not hits
    else:
        assert [d.matched_stop for d in hits] == [stop]
        assert hits[0].num_tokens == next(n for n in range(len(text) + 1)
                                          if any(s in text[:n] for s in stops))


def test_stop_late_in_a_long_stream_with_held_bytes(tok: Tokenizer) -> None:
    """The token that completed a match is exact also deep into a stream (after the decoder has
    trimmed its window) and when the chunk that matched was held back over several tokens."""
    text = "lorem ipsum dolor sit amet " * 40 + "你好世界🎉 the end"
    ids = tok.encode(text).ids
    for stop in ("世界🎉", "🎉 the", "界"):
        for sizes in (1, 3):
            out, deltas = run(tok, ids, StopConditions(stop=(stop,)), sizes)
            assert out == text[:text.index(stop)]
            (hit,) = [d for d in deltas if d.stopped]
            assert hit.num_tokens == next(n for n in range(1, len(ids) + 1)
                                          if stop in tok.decode(ids[:n]))
