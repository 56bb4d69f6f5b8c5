"""Tool-call syntax `llama3` (Llama 3.x JSON tool calling): the whole answer is one call object,
`{"name": "f", "parameters": {..}}`, optionally after `<|python_tag|>`. An answer that does not
open with `{` is content; one that does is decided when it ends (a call if it parses)."""

from __future__ import annotations

from minisgl_core.bounded_json import loads_bounded

from minisgl_gateway.agent.base import ToolCall, ToolDelta, ToolParser, parse_call

PYTHON_TAG = "<|python_tag|>"


class Llama3Calls(ToolParser):
    name = "llama3"
    args_key = "parameters"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._mode = "start"  # start | call (the answer opened with "{") | text

    @staticmethod
    def grammar(call: str, parallel: bool) -> str:
        return f"start: {call}\n"  # Llama 3.x writes one JSON call

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolDelta]]:
        content, calls = self._feed(text, final)
        return content, self.whole_calls(calls)

    def _feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        self._buf += text
        if self._mode == "text":
            out, self._buf = self._buf, ""
            return out, []
        head = self._buf.strip()
        body = head.removeprefix(PYTHON_TAG).lstrip()
        if self._mode == "start":
            undecided = not body or PYTHON_TAG.startswith(head)
            if undecided and not final:
                return "", []
            self._mode = "call" if body.startswith("{") else "text"
            if self._mode == "text":
                out, self._buf = self._buf, ""
                return out, []
        if not final:
            return "", []
        try:
            call = parse_call(loads_bounded(body), self.args_key)
        except ValueError:
            call = None
        out, self._buf = ("", "") if call else (self._buf, "")
        return out, [call] if call else []
