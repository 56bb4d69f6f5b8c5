"""What `Scheduler.submit` refuses before a request is queued, with messages for the client."""

from __future__ import annotations

from minisgl_core.sampling import InvalidParams, SamplingParams
from minisgl_core.step import WorkerInfo

from minisgl_scheduler.errors import ContextLengthExceeded, InvalidRequest


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
