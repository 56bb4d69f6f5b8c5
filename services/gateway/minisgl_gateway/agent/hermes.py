"""Tool-call syntax `hermes` (Qwen2.5, Qwen3):

    <tool_call>
    {"name": "f", "arguments": {..}}
    </tool_call>

one block per call. A call written name first streams its name, then its arguments as they are
generated."""

from __future__ import annotations

import re

from minisgl_gateway.agent.marked import MarkedCalls


class HermesCalls(MarkedCalls):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    head = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')

    @staticmethod
    def grammar(call: str, parallel: bool) -> str:
        calls = 'call ("\\n" call)*' if parallel else "call"
        return f'start: {calls}\ncall: "<tool_call>\\n" {call} "\\n</tool_call>"\n'
