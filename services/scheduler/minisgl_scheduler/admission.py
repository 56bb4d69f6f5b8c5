"""Admission: what `Scheduler.submit` refuses before a request is queued (with messages for the
client), the request it queues, and the order and memory reserve the planner admits waiting
requests by."""

from __future__ import annotations

from minisgl_core.sampling import InvalidParams, SamplingParams
from minisgl_core.step import WorkerInfo

from minisgl_scheduler.config import SchedulerConfig
from minisgl_scheduler.errors import ContextLengthExceeded, InvalidRequest
from minisgl_scheduler.radix import RadixCache
from minisgl_scheduler.request import Request
from minisgl_scheduler.tenants import TenantTurns


def check_request(info: WorkerInfo, input_ids: list[int], params: SamplingParams) -> None:
    """Raise InvalidRequest / ContextLengthExceeded for a request that can never run."""
    if not input_ids:
        raise InvalidRequest("the prompt is empty; at least one token is required")
    bad = next((t for t in input_ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {info.vocab_size})")
    n = len(input_ids)
    if n + 1 > info.max_model_len:
        raise ContextLengthExceeded(
            f"the prompt has {n} tokens but the model's context window is "
            f"{info.max_model_len} tokens, which must also hold at least one output token "
            f"(at most {info.max_model_len - 1} prompt tokens)"
        )
    capacity = info.num_pages * info.page_size
    if n > capacity:
        raise ContextLengthExceeded(
            f"the prompt has {n} tokens but the KV cache holds only {capacity} tokens"
        )
    try:
        params.validate()
    except InvalidParams as exc:
        raise InvalidRequest(str(exc)) from None


def resume_split(input_ids: list[int], params: SamplingParams, num_prompt_tokens: int) -> int:
    """The prompt length of a submitted request: all of `input_ids`, or for a resumed one its
    first `num_prompt_tokens` (the rest are outputs made before, which count toward max_tokens).
    Raises InvalidRequest when the split is impossible or nothing is left to generate."""
    n = len(input_ids)
    if num_prompt_tokens <= 0:
        return n
    if num_prompt_tokens > n:
        raise InvalidRequest(f"num_prompt_tokens {num_prompt_tokens} exceeds the {n} input tokens")
    if n - num_prompt_tokens >= params.max_tokens:
        raise InvalidRequest(f"the request already has {n - num_prompt_tokens} of its "
                             f"{params.max_tokens} output tokens; nothing is left to generate")
    return num_prompt_tokens


def new_request(info: WorkerInfo, eos_ids: frozenset[int], rid: int, input_ids: list[int],
                params: SamplingParams, arrival: int, salt: int = 0,
                prompt_len: int | None = None) -> Request:
    """A checked request as it enters the queue: its stop tokens and its output budget clipped
    to the context window. `prompt_len` < len(input_ids): a resumed request, whose trailing
    inputs are outputs already made; the window and max_tokens count from the prompt, so it
    ends at the same total length as it would have without the move."""
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
    n = len(input_ids)
    p = n if prompt_len is None else prompt_len
    return Request(
        rid=rid, prompt_len=p, params=params, max_tokens=min(params.max_tokens,
                                                             info.max_model_len - p),
        stop_ids=frozenset(stop), arrival=arrival, tokens=list(input_ids), target=n, salt=salt,
    )


def waiting_order(waiting: list[Request], cache: RadixCache | None, config: SchedulerConfig,
                  turns: TenantTurns) -> list[Request]:
    """Priority first (lower values first). Within a priority: arrival order with tenants taken
    in turn (tenants.py), or with policy "lpm" (and a usable cache, a short enough queue) the
    longest cached prefix first. `waiting` is in arrival order."""
    if config.policy == "lpm" and cache is not None and len(waiting) <= config.lpm_max_queue:
        hits = {id(r): cache.match(r.tokens[: r.target - 1], salt=r.salt).num_pages
                for r in waiting}
        return sorted(waiting, key=lambda r: (r.priority, -hits[id(r)], r.arrival))
    first = waiting[0] if waiting else None
    if first is None or all(r.priority == first.priority and r.tenant == first.tenant
                            for r in waiting):
        return list(waiting)  # the common case: plain arrival order
    return turns.order(waiting)


def reserve_pages(r: Request, page_size: int, decode_reserve_ratio: float) -> int:
    """Pages kept back for a running request: the rest of its prefill, a share of decode."""
    left = r.max_tokens - r.num_outputs - r.pending_samples
    future = (r.target - r.computed) + int(left * decode_reserve_ratio)
    return max(0, -(-(r.computed + future) // page_size) - len(r.pages))
