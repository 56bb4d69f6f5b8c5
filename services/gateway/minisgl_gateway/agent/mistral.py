"""Tool-call syntax `mistral`: `[TOOL_CALLS]` and then a JSON array of calls to the end of the
answer, `[TOOL_CALLS][{"name": "f", "arguments": {..}}, ..]`. `[TOOL_CALLS]` is a special token
in Mistral vocabularies: the text must keep special tokens for it to be seen."""

from __future__ import annotations

from minisgl_gateway.agent.marked import MarkedCalls


class MistralCalls(MarkedCalls):
    name = "mistral"
    start = "[TOOL_CALLS]"
    keeps_special_tokens = True

    @staticmethod
    def grammar(call: str, parallel: bool) -> str:
        arr = '"[" item ("," item)* "]"' if parallel else '"[" item "]"'
        return f'start: "[TOOL_CALLS]" {arr}\nitem: {call}\n'
