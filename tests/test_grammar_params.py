"""Grammar and logit_bias cross gateway -> scheduler -> worker on SamplingParams unchanged."""

from __future__ import annotations

import pytest
from minisgl_core.convert import sampling_from_proto, sampling_to_proto, worker_sampling_from_proto
from minisgl_core.sampling import GrammarSpec, InvalidParams, SamplingParams


@pytest.mark.parametrize("grammar", [None, GrammarSpec("json_object"),
                                     GrammarSpec("json_schema", '{"type": "integer"}'),
                                     GrammarSpec("regex", "[ab]+"),
                                     GrammarSpec("lark", 'start: "x"')])
def test_round_trip(grammar: GrammarSpec | None) -> None:
    p = SamplingParams(grammar=grammar, logit_bias={5: -100.0, 7: 2.5}, max_tokens=9)
    back = sampling_from_proto(sampling_to_proto(p))
    assert back == p
    assert worker_sampling_from_proto(sampling_to_proto(p)).grammar == grammar


def test_bias_out_of_range_is_refused() -> None:
    with pytest.raises(InvalidParams, match="logit_bias"):
        worker_sampling_from_proto(sampling_to_proto(SamplingParams(logit_bias={1: 101.0})))
