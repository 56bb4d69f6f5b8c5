"""A generation job: what both public protocols (OpenAI HTTP, minisgl.v1 gRPC) reduce a request to,
and the checks every job passes before it goes upstream. One copy of the rules for both."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from minisgl_core.convert import sampling_from_proto
from minisgl_core.proto.minisgl.v1 import common_pb2, tokenizer_pb2
from minisgl_core.sampling import InvalidParams, SamplingParams

from minisgl_gateway.config import Limits
from minisgl_gateway.errors import invalid

INT32_MAX = 2**31 - 1
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}  # "developer" means "system"
SEED_LIMIT = 2**63

# How max_tokens is chosen when the client leaves it out.
#   "context": the rest of the context window (OpenAI chat); "server": the scheduler's default
#   (the proto's max_tokens = 0); an int: that many (OpenAI completions: 16).
MaxTokensDefault = Literal["context", "server"] | int


@dataclass
class Job:
    kind: Literal["chat", "completion"]
    model: str  # as the client named it; "" selects the served model
    prompts: list[tokenizer_pb2.TokenizeItem]
    sampling: common_pb2.SamplingParams
    stop: common_pb2.StopConditions = field(default_factory=common_pb2.StopConditions)
    n: int = 1
    max_tokens_default: MaxTokensDefault = "server"
    prompt_param: str = "prompt"  # the field a prompt error points at
    request_id: str = ""
    user: str = ""  # OpenAI's end-user id: routing and logs
    echo: bool = False  # completions: each choice starts with its prompt's text
    tool_parser: str = ""  # output parsers by name (agent/registry.py); "" = off
    reasoning_parser: str = ""
    grammar_param: str = ""  # the request field the grammar came from (errors name it)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    session: str = ""  # sticky-routing key: OpenAI `user`, or the x-session-id header
    # Prefix-cache namespace (vLLM's cache_salt, plus the API key's with --cache-salt-per-key):
    # only requests with equal salts reuse each other's cached prompt pages.
    cache_salt: str = ""
    # vLLM's priority: lower values are scheduled first (0 by default), and may preempt.
    priority: int = 0
    tenant: int = 0  # the API key's hash while per-key flags are on (Gateway.tenant), else 0

    @property
    def num_choices(self) -> int:
        return self.n * len(self.prompts)


def _core(sp: common_pb2.SamplingParams) -> SamplingParams:
    """The shared dataclass, for its range checks (unset optionals take their defaults);
    max_tokens 0 is decided later, after tokenizing."""
    return sampling_from_proto(sp, default_max_tokens=INT32_MAX)


# SamplingParams.validate messages start with the field name; the error's `param` is that name.
def _param_of(message: str) -> str:
    return message.split(" ", 1)[0]


def check_job(job: Job, limits: Limits, max_model_len: int, vocab_size: int) -> None:
    """Every rule that does not need the prompt's tokens. Raises ApiError (400)."""
    sp = job.sampling
    if not job.prompts:
        raise invalid(f"{job.prompt_param} must not be empty", param=job.prompt_param)
    if len(job.prompts) > limits.max_prompts:
        raise invalid(f"at most {limits.max_prompts} prompts per request", param="prompt")
    for item in job.prompts:
        if item.WhichOneof("input") is None:
            raise invalid(f"{job.prompt_param} is required", param=job.prompt_param)
        if item.HasField("token_ids"):
            if not item.token_ids.ids:
                raise invalid("a token-id prompt must not be empty", param=job.prompt_param)
            if len(item.token_ids.ids) >= max_model_len:  # before the per-id loop below
                raise invalid(f"the prompt has {len(item.token_ids.ids)} tokens; at most "
                              f"{max_model_len - 1} fit the context window of {max_model_len}",
                              param=job.prompt_param, code="context_length_exceeded")
            if any(not 0 <= t < vocab_size for t in item.token_ids.ids):
                raise invalid(f"token ids in the prompt must be in [0, {vocab_size})",
                              param=job.prompt_param)
    if not 1 <= job.n <= limits.max_n:
        raise invalid(f"n must be in [1, {limits.max_n}]", param="n")
    if job.num_choices > limits.max_prompts:
        raise invalid(f"n x prompts must be at most {limits.max_prompts}", param="n")
    if sp.max_tokens < 0:
        raise invalid("max_tokens must be >= 1", param="max_tokens")
    cap = min(limits.max_completion_tokens or max_model_len, max_model_len)
    if sp.max_tokens > cap:
        raise invalid(f"max_tokens is {sp.max_tokens} but at most {cap} tokens can be generated "
                      f"(the model's context window is {max_model_len})", param="max_tokens",
                      code="context_length_exceeded")
    if sp.min_tokens < 0:
        raise invalid("min_tokens must be >= 0", param="min_tokens")
    if sp.max_tokens and sp.min_tokens > sp.max_tokens:
        raise invalid("min_tokens must not exceed max_tokens", param="min_tokens")
    if sp.top_logprobs and not sp.logprobs:
        raise invalid("top_logprobs requires logprobs", param="top_logprobs")
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        value = getattr(sp, name)
        if not math.isfinite(value):
            raise invalid(f"{name} must be a finite number", param=name)
    try:
        _core(sp).validate(max_top_logprobs=limits.max_top_logprobs)
    except InvalidParams as exc:
        raise invalid(str(exc), param=_param_of(str(exc))) from None
    bad = [t for t in sp.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise invalid(f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
    if len(sp.stop_token_ids) > limits.max_stop * 4:
        raise invalid(f"at most {limits.max_stop * 4} stop_token_ids", param="stop_token_ids")
    bad = [t for t in sp.logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise invalid(f"logit_bias token ids must be in [0, {vocab_size}) (got {bad[0]})",
                      param="logit_bias")
    # The grammar itself is compiled by `check_grammar`, in a thread (Generation.start).
    if sp.HasField("grammar") and (sp.ignore_eos or sp.min_tokens):
        raise invalid("ignore_eos and min_tokens cannot be combined with a grammar (the "
                      "grammar ends the output)", param=job.grammar_param)
    if len(job.stop.stop) > limits.max_stop:
        raise invalid(f"at most {limits.max_stop} stop strings", param="stop")
    for s in job.stop.stop:
        if not s:
            raise invalid("stop strings must not be empty", param="stop")
        if len(s) > limits.max_stop_len:
            raise invalid(f"stop strings must be at most {limits.max_stop_len} characters",
                          param="stop")


def check_grammar(job: Job) -> None:
    """Compiles the job's grammar, if any (400 quoting the compiler). Blocking: a large schema
    takes the compiler a while, so callers on the event loop run it in a thread."""
    if job.sampling.HasField("grammar"):
        from minisgl_gateway.api.structured import validate

        validate(job.sampling.grammar, job.grammar_param)


MAX_CACHE_SALT_LEN = 256


def check_cache_salt(salt: str | None, param: str = "cache_salt") -> str:
    """The client's salt ("" when absent); an empty string would silently share, so it is an
    error, as in vLLM."""
    if salt is None:
        return ""
    if not salt:
        raise invalid("cache_salt must be a non-empty string", param=param)
    if len(salt) > MAX_CACHE_SALT_LEN:
        raise invalid(f"cache_salt must be at most {MAX_CACHE_SALT_LEN} characters", param=param)
    return salt


def resolve_max_tokens(job: Job, prompt_len: int, max_model_len: int, limits: Limits) -> int:
    """max_tokens for one prompt of `prompt_len` tokens (0: the scheduler's default)."""
    room = max_model_len - prompt_len
    requested = job.sampling.max_tokens
    if requested:
        if requested > room:
            raise invalid(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                f"{requested} for the completion). Reduce the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded")
        return requested
    default = job.max_tokens_default
    if default == "server":
        return 0
    cap = min(limits.max_completion_tokens or max_model_len, room)
    value = cap if default == "context" else min(int(default), cap)
    if value < 1:
        raise invalid(f"the prompt ({prompt_len} tokens) leaves no room to generate in the "
                      f"context window of {max_model_len} tokens", param=job.prompt_param,
                      code="context_length_exceeded")
    if job.sampling.min_tokens > value:
        raise invalid(f"min_tokens ({job.sampling.min_tokens}) exceeds the {value} tokens this "
                      "request can generate", param="min_tokens")
    return value


def choice_seed(seed: int, choice: int) -> int:
    """Choice i of a seeded request samples with seed + i: reproducible, and choices differ."""
    return (seed + choice) % SEED_LIMIT


def require_int(value: int, name: str, lo: int = 0, hi: int = INT32_MAX) -> int:
    if not lo <= value <= hi:
        raise invalid(f"{name} must be in [{lo}, {hi}]", param=name)
    return value
