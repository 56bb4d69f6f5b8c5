"""What both public APIs do with a choice's text before they format it: the completions echo (the
prompt's text first) and, for chat, the output parsers (agent/) that split it into reasoning,
content and tool calls. One `ChoiceOutputs` per response, one parser per choice; the HTTP
formatter (openai_format.py) and the gRPC one (grpc_format.py) both read it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from minisgl_gateway.agent.choice_parser import ChoiceParser, Delta
from minisgl_gateway.api.generation import ChoiceChunk
from minisgl_gateway.api.job import Job


async def echo_prefixes(job: Job, detokenize: Callable[[list[int]], Awaitable[str]]
                        ) -> list[str] | None:
    """Completions echo: the text each choice starts with, its prompt's (token-id prompts
    decoded); None when the job does not echo."""
    if not job.echo:
        return None
    texts = [p.text if p.HasField("text") else await detokenize(list(p.token_ids.ids))
             for p in job.prompts]
    return [texts[i // job.n] for i in range(job.num_choices)]


class ChoiceOutputs:
    def __init__(self, tool_parser: str = "", reasoning_parser: str = "",
                 echo: list[str] | None = None) -> None:
        """Parsers by name ("" = off); `echo`: the text each choice starts with."""
        self._syntax = (tool_parser, reasoning_parser)
        self.parsing = any(self._syntax)
        self.reasoning = bool(reasoning_parser)
        self.parsers: dict[int, ChoiceParser] = {}  # by choice index, once it has output
        self._echo = echo
        self.echoing = echo is not None  # streams skip echo_into without it
        self._echoed: set[int] = set()
        self._whole: dict[int, Delta] = {}  # unary answers parsed chunk by chunk (observe)

    def echo_into(self, c: ChoiceChunk) -> None:
        """The prompt's text before the choice's first text (completions echo)."""
        if self._echo is not None and c.index not in self._echoed:
            self._echoed.add(c.index)
            c.text = self._echo[c.index] + c.text

    def parse(self, c: ChoiceChunk) -> Delta:
        """The chunk through its choice's parsers (a stream's next piece)."""
        parser = self.parsers.get(c.index)
        if parser is None:
            parser = self.parsers[c.index] = ChoiceParser(*self._syntax)
        return parser.feed(c.text, len(c.token_ids), final=c.finish_reason is not None)

    def observe(self, c: ChoiceChunk) -> None:
        """A unary answer's chunks as they come (`Generation.collect`): parsed one by one, so
        reasoning tokens are counted per chunk as in a stream."""
        if not self.parsing:
            return
        d = self.parse(c)
        whole = self._whole.setdefault(c.index, Delta())
        whole.reasoning += d.reasoning
        whole.content += d.content
        whole.tools += d.tools

    def whole(self, c: ChoiceChunk) -> Delta:
        """A unary answer's choice, parsed: what `observe` gathered, else its whole text."""
        return self._whole.get(c.index) or self.parse(c)

    def finish_reason(self, c: ChoiceChunk) -> str | None:
        """OpenAI's: "tool_calls" for a choice that stopped after making calls."""
        parser = self.parsers.get(c.index)
        if c.finish_reason == "stop" and parser is not None and parser.made_calls:
            return "tool_calls"
        return c.finish_reason

    def reasoning_tokens(self) -> int | None:
        if not self.reasoning:
            return None
        return sum(p.reasoning_tokens for p in self.parsers.values())
