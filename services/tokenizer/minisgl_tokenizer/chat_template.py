"""The model's chat template, rendered the way transformers' `apply_chat_template` renders it.

Same Jinja environment: an immutable sandbox with `trim_blocks` and `lstrip_blocks`, the
loop-controls extension (`break`/`continue`), a `{% generation %}` block tag (rendered as its body),
the `tojson` filter without HTML escaping, and the globals `raise_exception`, `strftime_now`, a
restricted `dict` and a `namespace` that refuses underscore names. Same inputs: `messages` with
None-valued keys dropped, `tools` (None when not given), `documents=None`, `add_generation_prompt`,
and the tokenizer's named special tokens (`bos_token`, `eos_token`, ...) as variables. The same
conversation therefore renders to the same string, and the same token ids once encoded without
special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from minisgl_core.bounded_json import TooDeep, loads_bounded


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render it."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; a server
    only needs the text, so the block renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def loads_field(text: str, name: str) -> Any:
    """JSON from the string field `name`; ValueError (the item's INVALID_ARGUMENT) when invalid
    or nested past MAX_JSON_DEPTH, where the template or the parser would hit RecursionError."""
    try:
        return loads_bounded(text, name)
    except TooDeep:
        raise
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from exc


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike Jinja's own tojson, no HTML escaping: prompts are not HTML.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes (no way to reach internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature: self may be a kwarg
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace: {name!r}")


def make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


class ChatTemplates:
    """The model's template(s): one, or several by name ("default", "tool_use", ...)."""

    def __init__(self, templates: Mapping[str, str], special_tokens: Mapping[str, str]) -> None:
        env = make_environment()
        try:
            self._compiled = {name: env.from_string(src) for name, src in templates.items()}
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"the model's chat template does not compile: {exc}") from exc
        self.sources = dict(templates)
        self.special_tokens = dict(special_tokens)

    def __bool__(self) -> bool:
        return bool(self._compiled)

    def select(self, tools: list | None) -> jinja2.Template:
        """Pick a template as transformers does: the only one; else "tool_use" when tools are
        given and it exists; else "default"."""
        if not self._compiled:
            raise ChatTemplateError("this model has no chat template; send text or token ids")
        if len(self._compiled) == 1:
            return next(iter(self._compiled.values()))
        if tools is not None and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        raise ChatTemplateError(
            f"the model has several chat templates and none is 'default': {sorted(self._compiled)}")

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True,
               template_kwargs: Mapping[str, Any] | None = None) -> str:
        """`template_kwargs`: extra template variables (OpenAI-compatible servers'
        chat_template_kwargs, e.g. enable_thinking=False); they cannot replace the ones set here."""
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in (
            "messages", "tools", "documents", "add_generation_prompt", *self.special_tokens)}
        if not messages:
            raise ChatTemplateError("messages must not be empty")
        template = self.select(tools)
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return template.render(
                messages=chat, tools=tools, documents=None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs,
            )
        except jinja2.exceptions.TemplateError as exc:  # raise_exception, undefined calls, ...
            raise ChatTemplateError(f"chat template: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from exc


def message_dict(role: str, content: str, name: str = "", tool_call_id: str = "",
                 tool_calls_json: str = "") -> dict[str, Any]:
    """One message as chat templates expect it. OpenAI sends tool-call arguments as a JSON string;
    templates (Qwen, Llama 3.1, ...) expect a mapping, so a string holding a JSON object is parsed,
    as vLLM does. Raises ValueError on malformed JSON."""
    if not role:
        raise ValueError("every message needs a role")
    msg: dict[str, Any] = {"role": role, "content": content}
    if name:
        msg["name"] = name
    if tool_call_id:
        msg["tool_call_id"] = tool_call_id
    if tool_calls_json:
        calls = loads_field(tool_calls_json, "tool_calls_json")
        if not isinstance(calls, list):
            raise ValueError("tool_calls_json must be a JSON array")
        msg["tool_calls"] = [_normalise_call(c) for c in calls]
    return msg


def _normalise_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = loads_field(fn["arguments"], "arguments")
        except ValueError:
            return call  # leave it for the template to show verbatim
        if isinstance(args, dict):
            return {**call, "function": {**fn, "arguments": args}}
    return call


def parse_tools(tools_json: str) -> list[dict[str, Any]] | None:
    """`tools_json` ("" for none) as the list of tool schemas the template receives."""
    if not tools_json:
        return None
    tools = loads_field(tools_json, "tools_json")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools_json must be a JSON array of objects")
    return tools
