"""One choice's output split into `reasoning_content`, `content` and `tool_calls`: the reasoning
parser first, then the tool-call parser on what is content. Each public API keeps one
`ChoiceParser` per choice of a response (api/choice_output.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl_gateway.agent.base import ToolCall, ToolDelta, assemble
from minisgl_gateway.agent.registry import REASONING_PARSERS, TOOL_PARSERS


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tools: list[ToolDelta] = field(default_factory=list)

    @property
    def calls(self) -> list[ToolCall]:
        """Whole calls (a unary answer feeds all its text at once)."""
        return assemble(self.tools)


class ChoiceParser:
    """Both parsers for one choice, by name (agent/registry.py); "" turns one off."""

    def __init__(self, tool_syntax: str, reasoning_syntax: str) -> None:
        self.reason = REASONING_PARSERS[reasoning_syntax]() if reasoning_syntax else None
        self.tools = TOOL_PARSERS[tool_syntax]() if tool_syntax else None
        self.reasoning_tokens = 0
        self._undecided_tokens = 0

    def feed(self, text: str, num_tokens: int = 0, final: bool = False) -> Delta:
        reasoning, content = "", text
        r = self.reason
        if r is not None:
            before = r.state
            reasoning, content = r.feed(text, final)
            if before == "content":
                pass
            elif r.entered:  # a chunk that reasoned (the one with </think> included)
                self.reasoning_tokens += self._undecided_tokens + num_tokens
                self._undecided_tokens = 0
            elif r.state == "start":
                self._undecided_tokens += num_tokens  # maybe the first pieces of <think>
        tools: list[ToolDelta] = []
        if self.tools is not None and (content or final):
            content, tools = self.tools.feed(content, final)
        return Delta(reasoning, content, tools)

    @property
    def passthrough(self) -> bool:
        """From here on text passes unchanged (reasoning over or never started, no tool
        parser): streams may take their plain-text fast path again."""
        r = self.reason
        return self.tools is None and (r is None or (r.state == "content" and not r.pending))

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and self.tools.calls > 0
