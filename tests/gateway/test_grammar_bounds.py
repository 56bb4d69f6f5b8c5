"""The gateway's bounded grammar compile: a tiny but ruinous grammar is a 400 naming its field,
by every kind of grammar, in well under a second; large ordinary ones still pass."""

from __future__ import annotations

import json
import time

import pytest
from minisgl_core.proto.minisgl.v1 import common_pb2
from minisgl_gateway.api.structured import validate
from minisgl_gateway.api.tool_choice import tool_grammar
from minisgl_gateway.errors import ApiError

RUINOUS = "((a{1000}){1000}){3}"


@pytest.mark.parametrize("grammar", [
    common_pb2.Grammar(regex=RUINOUS),
    common_pb2.Grammar(json_schema=json.dumps({"type": "string", "pattern": f"^{RUINOUS}$"})),
    common_pb2.Grammar(lark=f"start: /{RUINOUS}/"),
], ids=["regex", "json_schema", "lark"])
def test_ruinous_grammar_is_a_400(grammar: common_pb2.Grammar) -> None:
    started = time.monotonic()
    with pytest.raises(ApiError) as info:
        validate(grammar, "the_field")
    assert time.monotonic() - started < 1.0
    assert info.value.status == 400 and info.value.param == "the_field"
    assert "too complex" in info.value.message


def test_large_ordinary_grammars_pass() -> None:
    props = {f"field_{j}": {"type": ["string", "integer", "boolean", "null"]} for j in range(300)}
    validate(common_pb2.Grammar(json_schema=json.dumps(
        {"type": "object", "properties": props, "required": list(props)[::3]})), "s")
    validate(common_pb2.Grammar(regex="a{5000}b"), "s")

    def tool(i: int) -> dict[str, object]:
        params = {f"p{j}": {"type": "string", "enum": [f"opt{k}" for k in range(8)]}
                  if j % 2 else {"type": "integer", "minimum": 0} for j in range(8)}
        return {"type": "function", "function": {"name": f"tool_{i}", "parameters": {
            "type": "object", "properties": params, "required": list(params)[:4]}}}

    validate(tool_grammar([tool(i) for i in range(40)], None, True, "hermes"), "tool_choice")
