"""Parser names -> parsers: the syntaxes `--tool-call-parser` and `--reasoning-parser` name, and
which ones a model gets when they are left at `auto`."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl_gateway.agent.base import ReasoningParser, ToolParser
from minisgl_gateway.agent.deepseek_r1 import DeepSeekR1Reasoning
from minisgl_gateway.agent.hermes import HermesCalls
from minisgl_gateway.agent.llama3 import Llama3Calls
from minisgl_gateway.agent.mistral import MistralCalls
from minisgl_gateway.agent.qwen3 import Qwen3Reasoning

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesCalls, Llama3Calls, MistralCalls)}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3Reasoning, "deepseek_r1": DeepSeekR1Reasoning}


@dataclass(frozen=True, slots=True)
class Formats:
    """The output syntaxes of the served model: a tool-call parser and a reasoning parser by
    name; "" = none."""

    tool: str = ""
    reasoning: str = ""


def tool_parser(name: str) -> type[ToolParser]:
    return TOOL_PARSERS[name]


def default_parsers(model_name: str) -> tuple[str, str]:
    """(tool parser, reasoning parser) for a model name; "" = none."""
    name = model_name.lower()
    if "llama" in name:
        return "llama3", ""
    if "mistral" in name or "mixtral" in name:
        return "mistral", ""
    return "hermes", "qwen3"


def resolve_formats(model_name: str, tool: str = "auto", reasoning: str = "auto") -> Formats:
    """The formats for the configured parser names: "auto" picks by model name, "none" (reasoning)
    turns the parser off."""
    auto_tool, auto_reasoning = default_parsers(model_name)
    return Formats(auto_tool if tool == "auto" else tool,
                   auto_reasoning if reasoning == "auto" else
                   ("" if reasoning == "none" else reasoning))
