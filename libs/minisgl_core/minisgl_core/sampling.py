"""Sampling parameters shared by every service (mirrors `minisgl.v1.SamplingParams`).

Kept free of torch: the gateway validates with it, the scheduler stores it, the worker reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidParams(ValueError):
    """A request parameter is out of range; the message is safe to show to the client."""


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What the output must match (`minisgl.v1.Grammar`): `kind` is one of GRAMMAR_KINDS, `spec`
    its text ("" for json_object). Hashable: the worker caches compiled grammars by it."""

    kind: str
    spec: str = ""


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 => greedy
    top_k: int = 0  # 0 => off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # same seed + same prompt => same tokens, whatever the batch
    repetition_penalty: float = 1.0  # HF semantics, over prompt + output tokens
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives returned per position when logprobs is on
    grammar: GrammarSpec | None = None  # constrained decoding (structured outputs, tool calls)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, max_top_logprobs: int = 20) -> None:
        checks = [
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (
                0 <= self.top_logprobs <= max_top_logprobs,
                f"top_logprobs must be in [0, {max_top_logprobs}]",
            ),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2**63)"),
            (all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()),
             "logit_bias values must be in [-100, 100]"),
            (self.grammar is None or self.grammar.kind in GRAMMAR_KINDS,
             f"grammar kind must be one of {GRAMMAR_KINDS}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidParams(message)
