"""What every output parser shares: the parsed pieces (`ToolCall`, `ToolDelta`), the two small
interfaces a syntax implements (`ToolParser`, `ReasoningParser`), and text helpers.

A parser works on the detokenized text of one choice (stop strings already applied), fed as it
streams (`final` on the last piece); a unary answer feeds all its text at once.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))


@dataclass(slots=True)
class ToolDelta:
    """A piece of the choice's call number `index`: the first carries id and name, the rest
    argument fragments (concatenated, they are the call's arguments JSON)."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


def assemble(deltas: list[ToolDelta]) -> list[ToolCall]:
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        call = calls.get(d.index)
        if call is None:
            call = calls[d.index] = ToolCall(d.name, "", d.id)
        call.arguments += d.arguments
    return [calls[k] for k in sorted(calls)]


def hold(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def parse_call(obj: Any, args_key: str) -> ToolCall | None:
    """A call object as the model wrote it (`{"name": .., args_key: {..}}`); None if it is not
    one. The other usual key for the arguments is accepted too."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


class ToolParser(ABC):
    """One tool-call syntax: splits content text into content and tool-call deltas, and says
    how a forced call is written (the grammar `tool_choice` compiles to)."""

    name: ClassVar[str]
    args_key: ClassVar[str] = "arguments"  # the key of the arguments object in a call
    # Its markers are special tokens: the detokenizer must keep special tokens in the text.
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self) -> None:
        self.calls = 0  # calls started so far

    @abstractmethod
    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolDelta]]:
        """(content delta, tool-call deltas) for the next piece of content text."""

    @staticmethod
    @abstractmethod
    def grammar(call: str, parallel: bool) -> str:
        """A Lark grammar for a forced answer: `call` is the rule (a `%json {..}` schema) for
        one call object; `parallel` allows several calls."""

    def whole_calls(self, calls: list[ToolCall]) -> list[ToolDelta]:
        """Complete calls as deltas: a name delta, then one arguments delta each."""
        out = []
        for call in calls:
            out.append(ToolDelta(self.calls, call.id, call.name))
            out.append(ToolDelta(self.calls, arguments=call.arguments))
            self.calls += 1
        return out


class ReasoningParser(Protocol):
    """One reasoning syntax: splits text into reasoning and content."""

    state: str  # "start" (undecided) | "reason" | "content"
    entered: bool  # reasoning was seen

    @property
    def pending(self) -> bool:
        """Text held back, or separators still to drop: the next piece may change."""
        ...

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta)."""
        ...
