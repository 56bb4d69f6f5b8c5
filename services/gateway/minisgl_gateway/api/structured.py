"""Request fields that constrain the output -> one `minisgl.v1.Grammar`, checked here (400 naming
the problem) before anything runs upstream. The worker compiles the same grammar against the
vocabulary (llguidance, both sides; the gateway needs no torch and no tokenizer to validate).

Sources, at most one per request:
  response_format   {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema"}}
  extra_body        structured_outputs {json | regex | grammar | choice} (vLLM), guided_json,
                    guided_regex, guided_grammar, guided_choice (vLLM, older), regex, ebnf (SGLang)
  tool_choice       "required" or a named function: a call in the model's tool-call syntax whose
                    arguments match the tool's JSON schema (see tool_grammar)
"""

from __future__ import annotations

import json
import re
from typing import Any

from minisgl_core.proto.minisgl.v1 import common_pb2

from minisgl_gateway.errors import invalid

# Compact JSON (no free whitespace): weak models cannot loop on blanks inside a structure.
_JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_text(g: common_pb2.Grammar) -> str:
    import llguidance

    kind = g.WhichOneof("spec")
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(g.json_schema,
                                                             overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(g.regex)
    return llguidance.LLMatcher.grammar_from_lark(g.lark)


def validate(g: common_pb2.Grammar, param: str) -> None:
    """Raises a 400 that quotes the compiler's message."""
    import llguidance

    try:
        message = llguidance.LLMatcher.validate_grammar(grammar_text(g))
    except ValueError as exc:
        message = str(exc)
    if message and not message.startswith("WARNING"):
        first = message.strip().splitlines()[0]
        raise invalid(f"invalid {param}: {first}", param=param)


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise invalid(f"{param} is not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, dict | bool):
        raise invalid(f"{param} must be a JSON Schema object", param=param)
    return json.dumps(schema)


def _choice_regex(choices: Any, param: str) -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str)
                                                                for c in choices):
        raise invalid(f"{param} must be a non-empty list of strings", param=param)
    return "|".join(re.escape(c) for c in choices)


def from_response_format(fmt: dict[str, Any] | None) -> common_pb2.Grammar | None:
    if not fmt:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.Grammar(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid("response_format.json_schema.schema is required",
                          param="response_format.json_schema")
        # strict or not, the schema is enforced (OpenAI's strict=false only hints).
        return common_pb2.Grammar(json_schema=_schema_text(spec["schema"],
                                                           "response_format.json_schema.schema"))
    raise invalid(f"response_format type {kind!r} is not supported (text, json_object, "
                  "json_schema)", param="response_format")


def from_extra(extra: dict[str, Any]) -> tuple[common_pb2.Grammar | None, str]:
    """(grammar, the field it came from) from vLLM/SGLang extension fields."""
    found: list[tuple[common_pb2.Grammar, str]] = []
    so = extra.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise invalid("structured_outputs must be an object", param="structured_outputs")
        extra = {**{f"guided_{k}": v for k, v in so.items()}, **extra}
    for key, value in extra.items():
        if value is None:
            continue
        if key == "guided_json":
            found.append((common_pb2.Grammar(json_schema=_schema_text(value, key)), key))
        elif key in ("guided_regex", "regex"):
            if not isinstance(value, str):
                raise invalid(f"{key} must be a string", param=key)
            found.append((common_pb2.Grammar(regex=value), key))
        elif key in ("guided_grammar", "ebnf"):
            if not isinstance(value, str):
                raise invalid(f"{key} must be a string (llguidance Lark syntax)", param=key)
            found.append((common_pb2.Grammar(lark=value), key))
        elif key == "guided_choice":
            found.append((common_pb2.Grammar(regex=_choice_regex(value, key)), key))
    if len(found) > 1:
        raise invalid(f"at most one of {[k for _, k in found]} may be given",
                      param=found[1][1])
    return found[0] if found else (None, "")


# -- tool calls ----------------------------------------------------------------------------------

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
    return [_function(t, i)[0] for i, t in enumerate(tools)]


def tool_grammar(tools: list[Any], only: str | None, parallel: bool,
                 syntax: str) -> common_pb2.Grammar:
    """A Lark grammar: one call (several with `parallel`) to `only` or any of `tools`, written
    the way `syntax` (a tool-call parser name) expects, arguments matching the tool's schema."""
    fns = [_function(t, i) for i, t in enumerate(tools)]
    if only is not None:
        fns = [f for f in fns if f[0] == only]
    args_key = "parameters" if syntax == "llama3" else "arguments"
    variants = [{"type": "object", "properties": {"name": {"const": name}, args_key: params},
                 "required": ["name", args_key], "additionalProperties": False}
                for name, params in fns]
    call: dict[str, object] = {"anyOf": variants} if len(variants) > 1 else variants[0]
    call["x-guidance"] = _JSON_OPTIONS
    body = "%json " + json.dumps(call)
    if syntax == "mistral":
        arr = '"[" item ("," item)* "]"' if parallel else '"[" item "]"'
        lark = f'start: "[TOOL_CALLS]" {arr}\nitem: {body}\n'
    elif syntax == "llama3":
        lark = f"start: {body}\n"  # Llama 3.x writes one JSON call
    else:  # hermes (Qwen2.5/Qwen3)
        calls = 'call ("\\n" call)*' if parallel else "call"
        lark = f'start: {calls}\ncall: "<tool_call>\\n" {body} "\\n</tool_call>"\n'
    return common_pb2.Grammar(lark=lark)
