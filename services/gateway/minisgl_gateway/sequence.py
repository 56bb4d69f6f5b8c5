"""What one request sees of the pipeline: its sequences (one per choice) and the step events that
arrive on its asyncio queue, already detokenized."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from minisgl_core.proto.minisgl.v1 import common_pb2

from minisgl_gateway.errors import ApiError


@dataclass(slots=True)
class StepEvent:
    """New output of one sequence for one scheduler step, after detokenization."""

    index: int  # the choice this sequence is
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[common_pb2.TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "error"
    matched_stop: str = ""
    error: ApiError | None = None
    cached_tokens: int = 0


@dataclass(eq=False, slots=True)
class Sequence:
    rid: int
    index: int
    sink: asyncio.Queue[StepEvent]
    stop: common_pb2.StopConditions
    detok_started: bool = False  # the detokenizer holds state for this rid
    done: bool = False  # the client side ended (finished, failed, stopped or cancelled)
    done_at: float = 0.0
    num_tokens: int = 0  # tokens delivered (up to a stop string)

    def end(self, event: StepEvent | None) -> None:
        if self.done:
            return
        self.done, self.done_at = True, time.monotonic()
        if event is not None:
            self.sink.put_nowait(event)
