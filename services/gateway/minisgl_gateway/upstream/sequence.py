"""What one request sees of the pipeline: its sequences (one per choice) and the step events that
arrive in its sink, already detokenized."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from minisgl_core.proto.minisgl.v1 import common_pb2, scheduler_pb2

from minisgl_gateway.errors import ApiError


class Upstream(Protocol):
    """The link to the engine a sequence runs on (scheduler_link.SchedulerLink; named here so
    that this module, below the link in the import graph, need not import it)."""

    address: str

    def abort(self, rid: int, stop: bool = False) -> None: ...

    def cancel(self, seqs: list[Sequence]) -> None: ...


@dataclass(slots=True)
class StepEvent:
    """New output of one sequence for one scheduler step, after detokenization.

    The token fields may be the scheduler message's own repeated fields (read-only sequences):
    copying them into lists for every token of every stream cost more than everything else the
    event does."""

    index: int  # the choice this sequence is
    text: str = ""
    token_ids: Seq[int] = field(default_factory=list)
    logprobs: Seq[float] = field(default_factory=list)
    top_logprobs: Seq[common_pb2.TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "error"
    matched_stop: str = ""
    error: ApiError | None = None
    cached_tokens: int = 0


class EventSink:
    """One request's step events: the pipeline puts, the request's task takes all that arrived.

    An asyncio.Queue did the same with a future, a getter deque and task accounting per event;
    this keeps at most one waiter, so a step costs each stream a single wake-up (none when the
    stream has not come back for the previous step's events yet)."""

    __slots__ = ("_events", "_waiter")

    def __init__(self) -> None:
        self._events: list[StepEvent] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, event: StepEvent) -> None:
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def empty(self) -> bool:
        return not self._events

    async def take(self) -> list[StepEvent]:
        """Every event not taken yet, in arrival order; waits for the first."""
        while not self._events:
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:  # cancelled: a later put must not resolve a future nobody awaits
                if self._waiter is waiter:
                    self._waiter = None
        events, self._events = self._events, []
        return events


@dataclass(eq=False, slots=True)
class Sequence:
    rid: int
    index: int
    sink: EventSink
    stop: common_pb2.StopConditions
    detok_started: bool = False  # the detokenizer holds state for this rid
    done: bool = False  # the client side ended (finished, failed, stopped or cancelled)
    done_at: float = 0.0
    num_tokens: int = 0  # tokens delivered (up to a stop string)
    traceparent: str = ""  # the request's span, for the detokenizer's (empty: not traced)
    request_id: str = ""  # the client's x-request-id, for the detokenizer's log lines
    link: Upstream | None = None  # the scheduler link it runs on
    item: scheduler_pb2.SubmitItem | None = None  # what was submitted: sent again on a retry
    session: str = ""  # sticky-routing key
    retried: bool = False  # moved to another engine once already
    # Every token sent to the detokenizer, in order: what a migrated sequence resumes after.
    outputs: list[int] = field(default_factory=list)
    # Moves to another engine after its first tokens in a row without a new token in between
    # (what --migration-attempts bounds; see Pipeline._migrate), and len(outputs) at the last.
    migrations: int = 0
    moved_at: int = 0
    # Its engine was lost after its first tokens went to the detokenizer: it ends with this error
    # once the detokenizer has answered for it, so the tokens from before the loss come first.
    lost: ApiError | None = None

    def end(self, event: StepEvent | None) -> None:
        if self.done:
            return
        self.done, self.done_at = True, time.monotonic()
        if event is not None:
            self.sink.put(event)
