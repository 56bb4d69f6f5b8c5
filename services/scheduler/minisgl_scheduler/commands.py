"""What gRPC threads ask of the loop thread, the only one that touches the `Scheduler`.

Each RPC event becomes one command in the loop's inbox (never one per token); the loop applies
them between steps, dispatching on the class (`SchedulerLoop._apply`: an exhaustive `match`, so a
command added here without a handler fails `mypy --strict`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeAlias

from minisgl_core.sampling import SamplingParams

from minisgl_scheduler.connection import Conn


@dataclass(frozen=True, slots=True)
class Submit:
    """One request of a Connect message, already out of protobuf (on the stream's thread)."""

    rid: int  # the client's, unique on its connection while live
    input_ids: list[int]
    params: SamplingParams
    traceparent: str = ""
    request_id: str = ""
    cache_salt: str = ""  # prefix-cache namespace ("" shares with every unsalted request)
    # A resumed request: input_ids[:num_prompt_tokens] is the prompt, the rest earlier outputs
    # (0: all prompt).
    num_prompt_tokens: int = 0
    priority: int = 0  # lower first (vLLM's convention)
    tenant: int = 0  # fair-share group within a priority (0: none)


@dataclass(frozen=True, slots=True)
class Open:
    """A Connect stream started."""

    conn: Conn


@dataclass(frozen=True, slots=True)
class Batch:
    """One Connect message: submits, then aborts, then stops (a stop string matched downstream),
    all by client rid, applied in that order."""

    conn: Conn
    submits: tuple[Submit, ...] = ()
    aborts: tuple[int, ...] = ()
    stops: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class HalfClose:
    """The client sends no more: end its stream once its live requests end."""

    conn: Conn


@dataclass(frozen=True, slots=True)
class Drop:
    """The stream ended (cancelled, broken, or done): abort what it still has live."""

    conn: Conn


@dataclass(frozen=True, slots=True)
class Call:
    """Run `fn` on the loop thread and hand its result (or exception) to `future`: the unary
    RPCs and Watch's cache snapshots, which must not race the step."""

    fn: Callable[[], Any]
    future: Future[Any]

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except Exception as exc:
            self.future.set_exception(exc)


@dataclass(frozen=True, slots=True)
class Wake:
    """Nothing to do: unblocks an idle loop so that it sees it was asked to stop."""


Command: TypeAlias = Open | Batch | HalfClose | Drop | Call | Wake
