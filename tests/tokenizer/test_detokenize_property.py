"""Incremental detokenization equals a full decode, whatever the token stream and however it is cut
into per-step updates, for several requests interleaved over one Detokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from minisgl_core.proto.minisgl.v1 import detokenizer_pb2
from minisgl_tokenizer import Detokenizer, DetokenizeUpdate, StopConditions
from tokenizers import Tokenizer

from .conftest import CHATML_SPECIALS, TINY_MODEL, train_bpe

REPLACEMENT = "\ufffd"


def reference(tok: Tokenizer, ids: list[int], skip: bool, spaces: bool,
              special: dict[int, str]) -> str:
    """What the whole stream must come to: tokenizer.decode, or with spaces between special tokens
    the decoded runs of ordinary tokens and the special tokens joined by single spaces."""
    if skip or not spaces:
        return tok.decode(ids, skip_special_tokens=skip)
    parts: list[str] = []
    run: list[int] = []
    for tid in ids:
        if tid in special:
            if run:
                parts.append(tok.decode(run))
                run = []
            parts.append(special[tid])
        else:
            run.append(tid)
    if run:
        parts.append(tok.decode(run))
    return " ".join(parts)


@pytest.fixture(scope="module", params=["trained-bpe", "tiny-model"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "tiny-model":
        path = TINY_MODEL / "tokenizer.json"
        if not path.exists():
            pytest.skip(f"{path} does not exist yet (the embedded tiny model is still being "
                        "trained); this parametrisation runs once it is there")
        return Tokenizer.from_file(str(path))
    return train_bpe(CHATML_SPECIALS)


def special_text(tok: Tokenizer) -> dict[int, str]:
    return {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}


@st.composite
def streams(draw: st.DrawFn, tok: Tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """A few requests' token ids (biased to bytes of multi-byte characters and special tokens),
    each cut into random update sizes."""
    vocab = tok.get_vocab_size()
    special = sorted(special_text(tok))
    multibyte = [tok.token_to_id(c) for c in "ÃäåðŁİĪ½¥¶ł" if tok.token_to_id(c) is not None]
    token = st.one_of(st.integers(0, vocab - 1), st.sampled_from(special or [0]),
                      st.sampled_from(multibyte or [0]))
    n_requests = draw(st.integers(1, 4))
    all_ids, all_cuts = [], []
    for _ in range(n_requests):
        ids = draw(st.lists(token, min_size=0, max_size=40))
        cuts: list[int] = []
        left = len(ids)
        while left > 0:
            cuts.append(draw(st.integers(1, min(5, left))))
            left -= cuts[-1]
        all_ids.append(ids)
        all_cuts.append(cuts)
    return all_ids, all_cuts


@pytest.mark.parametrize("skip,spaces", [(True, True), (False, False), (False, True)])
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deltas_concatenate_to_full_decode(tokenizer: Tokenizer, skip: bool, spaces: bool,
                                           data: st.DataObject) -> None:
    special = special_text(tokenizer)
    all_ids, all_cuts = data.draw(streams(tokenizer))
    # The service hands the decoder protobuf repeated fields, not lists (a faster path inside).
    as_proto = data.draw(st.booleans())
    detok = Detokenizer(tokenizer, special)
    stop = StopConditions(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    texts = [""] * len(all_ids)
    positions = [0] * len(all_ids)
    steps = max((len(c) for c in all_cuts), default=0) + 1
    for step in range(steps):
        updates = []
        for rid, (ids, cuts) in enumerate(zip(all_ids, all_cuts, strict=True)):
            if step > len(cuts):
                continue
            new = ids[positions[rid]:positions[rid] + cuts[step]] if step < len(cuts) else []
            positions[rid] += len(new)
            if as_proto:
                new = detokenizer_pb2.DetokenizeUpdate(token_ids=new).token_ids
            updates.append(DetokenizeUpdate(rid, new, stop if step == 0 else None,
                                            finished=step == len(cuts)))
        deltas = detok.step(updates)
        assert [d.rid for d in deltas] == [u.rid for u in updates]
        for update, delta in zip(updates, deltas, strict=True):
            full = reference(tokenizer, all_ids[update.rid], skip, spaces, special)
            texts[update.rid] += delta.text
            assert not delta.stopped
            # Every prefix shown is a prefix of the final text: nothing is taken back, no broken
            # character or U+FFFD is shown unless the full decode has it there.
            assert full.startswith(texts[update.rid])
            if REPLACEMENT in delta.text and not update.finished:
                assert REPLACEMENT in full
    for rid, ids in enumerate(all_ids):
        assert texts[rid] == reference(tokenizer, ids, skip, spaces, special)
    assert detok.active == 0


@pytest.mark.parametrize("use_stream", [True, False], ids=["rust-stream", "python-window"])
@pytest.mark.parametrize("skip,spaces", [(True, True), (False, True)])
def test_long_streams_keep_a_small_window(tokenizer: Tokenizer, skip: bool, spaces: bool,
                                          use_stream: bool) -> None:
    """Thousands of tokens per request: same text as a full decode, nothing shown is taken back,
    and the decoder's window of ids stays small (the cost per step does not grow with the length).
    Also covers the Python window decode, the fallback when DecodeStream is missing or fails."""
    import random

    from minisgl_tokenizer import IncrementalDecoder

    rng = random.Random(7)
    special = special_text(tokenizer)
    vocab = tokenizer.get_vocab_size()
    for _ in range(3):
        ids = [rng.randrange(vocab) for _ in range(3000)]
        full = reference(tokenizer, ids, skip, spaces, special)
        decoder = IncrementalDecoder(tokenizer, skip, spaces, special, use_stream=use_stream)
        shown, pos, longest = "", 0, 0
        while pos < len(ids):
            size = rng.choice([1, 1, 1, 2, 7])
            shown += decoder.push(ids[pos:pos + size], final=pos + size >= len(ids))
            pos += size
            longest = max(longest, len(decoder.ids))
            assert full.startswith(shown)
        assert shown == full
        assert longest < 200
