"""Request fields that constrain the output -> one `minisgl.v1.Grammar`, checked here (400 naming
the problem) before anything runs upstream. The worker compiles the same grammar against the
vocabulary (llguidance, both sides; the gateway needs no torch and no tokenizer to validate).

Validation is a bounded compile (minisgl_core.grammar_limits): the grammar is built against a
byte-level vocabulary under the worker's parser limits and its first masks computed, so a tiny but
ruinous grammar (nested counted repetition) is a 400 here in tens of milliseconds and never reaches
the worker, where compiling it would cost most of a second and ~150 MB.

Sources, at most one per request:
  response_format   {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema"}}
  extra_body        structured_outputs {json | regex | grammar | choice} (vLLM), guided_json,
                    guided_regex, guided_grammar, guided_choice (vLLM, older), regex, ebnf (SGLang)
  tool_choice       "required" or a named function: a call in the model's tool-call syntax whose
                    arguments match the tool's JSON schema (api/tool_choice.py)
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import TYPE_CHECKING, Any

from minisgl_core.grammar_limits import parser_limits, probe
from minisgl_core.proto.minisgl.v1 import common_pb2

from minisgl_gateway.api.json_body import parse_json_field
from minisgl_gateway.errors import invalid

if TYPE_CHECKING:
    import llguidance

# Compact JSON (no free whitespace): weak models cannot loop on blanks inside a structure.
JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_text(g: common_pb2.Grammar) -> str:
    import llguidance

    kind = g.WhichOneof("spec")
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(g.json_schema,
                                                             overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(g.regex)
    return llguidance.LLMatcher.grammar_from_lark(g.lark)


class _ByteVocab:
    """A vocabulary of the 256 bytes and an EOS: what llguidance needs to build a matcher."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"</s>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab()))


def validate(g: common_pb2.Grammar, param: str) -> None:
    """Raises a 400 that quotes the compiler's message, or says the grammar is past the bounds
    of a compile (minisgl_core.grammar_limits)."""
    import llguidance

    try:
        text = grammar_text(g)
        message = llguidance.LLMatcher.validate_grammar(text)
    except ValueError as exc:
        message = str(exc)
    if message and not message.startswith("WARNING"):
        first = message.strip().splitlines()[0]
        raise invalid(f"invalid {param}: {first}", param=param)
    # Runs on the event loop: the limits keep it short even for the grammars it refuses.
    error = probe(llguidance.LLMatcher(_byte_tokenizer(), text, log_level=0,
                                       limits=parser_limits()))
    if error:
        first = error.strip().splitlines()[0]
        raise invalid(f"invalid {param}: grammar too complex to compile within bounds ({first})",
                      param=param)


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        schema = parse_json_field(schema, param)
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
