"""`tools` and `tool_choice` -> what a chat job does with them: one set of rules for both public
APIs (each reads its own request shape, then calls `resolve` and `apply`).

    choice    "none" | "auto" | "required" | a function that must be called (`ToolChoice`)
    parsers   the job's tool-call parser is on when tools are given and the choice is not "none";
              its reasoning parser is the served model's
    grammar   "required" or a named function: a grammar forces a call written in the model's
              tool-call syntax (agent/registry.py), arguments matching the tool's JSON schema;
              "required" allows several calls unless the request turned parallel calls off;
              no other grammar source may be given with it
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from minisgl_core.proto.minisgl.v1 import common_pb2

from minisgl_gateway.agent.registry import Formats, tool_parser
from minisgl_gateway.api.job import Job
from minisgl_gateway.api.structured import JSON_OPTIONS
from minisgl_gateway.errors import invalid

KEYWORDS = ("none", "auto", "required")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "function"]
    function: str = ""  # mode "function": the one to call

    @property
    def forced(self) -> bool:
        """A call must be made (a grammar says how)."""
        return self.mode in ("required", "function")


_KEYWORD_CHOICES: dict[str, ToolChoice] = {
    c.mode: c for c in (ToolChoice("none"), ToolChoice("auto"), ToolChoice("required"))}


def _function(tool: Any, index: int) -> tuple[str, dict[str, Any]]:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
            not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise invalid(f"tools.{index} must be {{'type': 'function', 'function': {{'name': ...}}}}",
                      param=f"tools.{index}")
    params = fn.get("parameters") or {"type": "object"}
    if not isinstance(params, dict):
        raise invalid(f"tools.{index}.function.parameters must be a JSON Schema object",
                      param=f"tools.{index}.function.parameters")
    return fn["name"], params


def tool_names(tools: list[Any]) -> list[str]:
    """The functions' names; a 400 naming the first tool that is not a function."""
    return [_function(t, i)[0] for i, t in enumerate(tools)]


def resolve(choice: str | None, tools: list[Any], tools_field: str,
            named: bool = False) -> ToolChoice:
    """The checked choice. `choice`: None when the client left it out ("auto" with tools, else
    "none"), a keyword, or a function's name (`named`, or any string that is no keyword); a
    given choice checks the tools' shape. `tools_field` is the request field that holds the
    tools ("tools", "tools_json"), for the error messages."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    names = tool_names(tools)
    if named or choice not in KEYWORDS:
        if choice not in names:
            raise invalid(f"tool_choice names function {choice!r}, which is not in "
                          f"{tools_field}", param="tool_choice")
        return ToolChoice("function", choice)
    if choice == "required" and not tools:
        raise invalid(f"tool_choice 'required' needs {tools_field}", param="tool_choice")
    return _KEYWORD_CHOICES[choice]


def apply(job: Job, tools: list[Any], choice: ToolChoice, formats: Formats,
          parallel: bool = True) -> None:
    """Sets the job's output parsers and, when a call is forced, its grammar. `parallel` False:
    one call at most."""
    job.reasoning_parser = formats.reasoning
    if tools and choice.mode != "none":
        job.tool_parser = formats.tool
        if formats.tool and tool_parser(formats.tool).keeps_special_tokens \
                and not job.stop.HasField("skip_special_tokens"):
            job.stop.skip_special_tokens = False  # its call marker is a special token
    if not choice.forced:
        return
    if job.sampling.HasField("grammar"):
        raise invalid("tool_choice 'required' or a named function cannot be combined with "
                      f"{job.grammar_param}", param="tool_choice")
    only = choice.function or None
    sampling = common_pb2.SamplingParams()  # the job's own copy: it may be the request's field
    sampling.CopyFrom(job.sampling)
    sampling.grammar.CopyFrom(tool_grammar(tools, only, parallel and only is None, formats.tool))
    job.sampling = sampling
    job.grammar_param = "tool_choice"


def tool_grammar(tools: list[Any], only: str | None, parallel: bool,
                 syntax: str) -> common_pb2.Grammar:
    """A Lark grammar: one call (several with `parallel`) to `only` or any of `tools`, written
    the way `syntax` (a tool-call parser name) expects, arguments matching the tool's schema."""
    fns = [_function(t, i) for i, t in enumerate(tools)]
    if only is not None:
        fns = [f for f in fns if f[0] == only]
    parser = tool_parser(syntax)
    args_key = parser.args_key
    variants = [{"type": "object", "properties": {"name": {"const": name}, args_key: params},
                 "required": ["name", args_key], "additionalProperties": False}
                for name, params in fns]
    call: dict[str, object] = {"anyOf": variants} if len(variants) > 1 else variants[0]
    call["x-guidance"] = JSON_OPTIONS
    return common_pb2.Grammar(lark=parser.grammar("%json " + json.dumps(call), parallel))
