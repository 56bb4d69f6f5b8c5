"""The gateway's side of migration without processes: the resumed submit and the seed it fixes."""

from __future__ import annotations

from minisgl_core.proto.minisgl.v1 import common_pb2, scheduler_pb2
from minisgl_gateway.upstream.migration import MigrationPolicy, fix_seed, resume_item


def test_resume_item_appends_the_outputs_and_marks_the_prompt() -> None:
    item = scheduler_pb2.SubmitItem(rid=7, input_ids=[1, 2, 3], cache_salt="s",
                                    sampling=common_pb2.SamplingParams(max_tokens=9, seed=4))
    resumed = resume_item(item, [10, 11])
    assert list(resumed.input_ids) == [1, 2, 3, 10, 11]
    assert resumed.num_prompt_tokens == 3
    assert (resumed.rid, resumed.cache_salt, resumed.sampling.seed) == (7, "s", 4)
    assert list(item.input_ids) == [1, 2, 3] and item.num_prompt_tokens == 0  # untouched
    # A second move resumes from the original prompt with every output so far.
    again = resume_item(item, [10, 11, 12])
    assert list(again.input_ids) == [1, 2, 3, 10, 11, 12] and again.num_prompt_tokens == 3


def test_fix_seed_only_for_unseeded_sampling() -> None:
    seeded = common_pb2.SamplingParams(temperature=0.7, seed=5)
    fix_seed(seeded)
    assert seeded.seed == 5
    greedy = common_pb2.SamplingParams(temperature=0.0)
    fix_seed(greedy)
    assert not greedy.HasField("seed")
    for sampled in (common_pb2.SamplingParams(temperature=0.7), common_pb2.SamplingParams()):
        fix_seed(sampled)  # no temperature: the default 1.0 samples
        assert sampled.HasField("seed") and 0 <= sampled.seed < 2**62


def test_policy_switch() -> None:
    assert MigrationPolicy().enabled
    assert not MigrationPolicy(attempts=0).enabled
