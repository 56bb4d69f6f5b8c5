"""Mid-stream migration: a sequence whose engine is lost after its first tokens continues on
another engine (or the same one once it is back), as one stream to the client.

The new engine gets the prompt followed by every token already sent to the detokenizer, with
`num_prompt_tokens` saying where the prompt ends: it counts those tokens toward max_tokens and
min_tokens and as outputs for penalties and grammars (as after a preemption), and its sampler's
draw depends only on (seed, position, token). So a greedy or seeded sequence continues exactly as
it would have on the lost engine. The sequence keeps its rid, so the detokenizer's incremental
text and stop-string state carry on: no text is repeated or lost.

A sequence without a seed would get one drawn by the new engine's sampler and diverge; with
migration on, the gateway fixes one per sequence at submit (`fix_seed`) instead.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from minisgl_core.proto.minisgl.v1 import common_pb2, scheduler_pb2

SEED_BITS = 62  # as the worker's own draw: inside the seed range of every component


@dataclass(frozen=True, slots=True)
class MigrationPolicy:
    attempts: int = 2  # moves per sequence at most; 0: never migrate (sequences with tokens fail)
    wait_s: float = 10.0  # how long a sequence waits for any engine to take it

    @property
    def enabled(self) -> bool:
        return self.attempts > 0


def fix_seed(sampling: common_pb2.SamplingParams) -> None:
    """Give a sampled (temperature > 0) request without a seed one of its own, so that a resumed
    run draws what the first would have. Greedy ones need none."""
    if sampling.HasField("seed"):
        return
    if sampling.HasField("temperature") and sampling.temperature == 0.0:
        return
    sampling.seed = secrets.randbits(SEED_BITS)


def resume_item(item: scheduler_pb2.SubmitItem, outputs: Seq[int]) -> scheduler_pb2.SubmitItem:
    """The submit that continues `item` after `outputs` (the tokens it already produced)."""
    resumed = scheduler_pb2.SubmitItem()
    resumed.CopyFrom(item)
    resumed.input_ids.extend(outputs)
    resumed.num_prompt_tokens = len(item.input_ids)
    return resumed
