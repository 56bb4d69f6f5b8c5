"""Choice chunks -> minisgl.v1 `Choice` messages: the gRPC twin of openai_format.py, over the
same per-choice output parsing (choice_output.py)."""

from __future__ import annotations

from minisgl_core.codes import FINISH_TO_PROTO, FinishReason
from minisgl_core.proto.minisgl.v1 import common_pb2, generation_pb2

from minisgl_gateway.api.choice_output import ChoiceOutputs
from minisgl_gateway.api.generation import ChoiceChunk, Usage
from minisgl_gateway.api.job import Job

# A choice that ended in error or abort raised before it got here: only these two reach clients.
_FINISH = {r.value: FINISH_TO_PROTO[r] for r in (FinishReason.STOP, FinishReason.LENGTH)}


class GrpcOutput:
    """Per response: fills each Choice message from its chunk, through the choice's parsers."""

    def __init__(self, job: Job, echo: list[str] | None) -> None:
        self.out = ChoiceOutputs(job.tool_parser, job.reasoning_parser, echo)

    def fill(self, choice: generation_pb2.Choice, chunk: ChoiceChunk, whole: bool = False
             ) -> None:
        """`whole`: a unary answer (tool calls complete, not as deltas)."""
        out = self.out
        if out.echoing:
            out.echo_into(chunk)
        if not out.parsing:
            fill_choice(choice, chunk)
            return
        d = out.whole(chunk) if whole else out.parse(chunk)
        chunk.text = d.content
        fill_choice(choice, chunk)
        if d.reasoning:
            choice.reasoning_content = d.reasoning
        if whole:
            for k, call in enumerate(d.calls):
                choice.tool_calls.add(index=k, id=call.id, name=call.name,
                                      arguments=call.arguments)
            return
        for t in d.tools:
            choice.tool_calls.add(index=t.index, id=t.id, name=t.name, arguments=t.arguments)


def fill_choice(choice: generation_pb2.Choice, chunk: ChoiceChunk) -> None:
    """Fills a Choice in place (`reply.choices.add()`): extending a repeated field with built
    messages copies each one through its serialized bytes."""
    choice.index = chunk.index
    if chunk.text:
        choice.text = chunk.text
    if chunk.token_ids:
        choice.token_ids.extend(chunk.token_ids)
    if chunk.matched_stop:
        choice.matched_stop = chunk.matched_stop
    if chunk.finish_reason:
        choice.finish_reason = _FINISH.get(chunk.finish_reason, common_pb2.FINISH_REASON_STOP)
    for t in chunk.logprobs:
        choice.logprobs.add(token_id=t.token_id, token=t.token, logprob=t.logprob,
                            top_token_ids=[i for i, _, _ in t.top],
                            top_tokens=[s for _, s, _ in t.top],
                            top_logprobs=[p for _, _, p in t.top])


def usage_message(usage: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=usage.prompt_tokens,
                            completion_tokens=usage.completion_tokens,
                            cached_tokens=usage.cached_tokens)
