"""Per-request state owned by the scheduler, and what it reports back per step."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from minisgl_core.codes import FinishReason as FinishReason  # re-exported: the shared enum
from minisgl_core.sampling import SamplingParams
from minisgl_core.step import StepOutput, TopLogprobs

from minisgl_scheduler.errors import SchedulerError
from minisgl_scheduler.radix import Node


class Phase(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds a slot: prefilling (possibly in chunks) or decoding
    ENDED = "ended"  # finished; resources go back once no in-flight step uses them


@dataclass(slots=True)
class TokenEvent:
    """What one `Scheduler.step` has for one request: new tokens and/or the end of it."""

    rid: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # aligned with token_ids when asked
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # likewise
    finish_reason: FinishReason | None = None
    error: SchedulerError | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False, slots=True)  # slots: attribute reads are the planner's inner loop
class Request:
    rid: int
    prompt_len: int
    params: SamplingParams
    max_tokens: int  # params.max_tokens clipped to the context window
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and the request's stop tokens
    arrival: int  # admission order; lower is higher priority when memory runs short
    tokens: list[int]  # prompt + every output token received so far
    phase: Phase = Phase.WAITING
    salt: int = 0  # prefix-cache namespace (prefix_hash.salt_seed of its cache_salt; 0: shared)
    priority: int = 0  # lower values first (vLLM's convention); ties go by arrival
    tenant: int = 0  # fair-share group: the waiting queue takes tenants in turn (0: none)

    # Placement on the worker (valid while RUNNING and until released).
    slot: int = -1
    pages: list[int] = field(default_factory=list)  # the slot's page-table row
    sent_pages: int = 0  # leading entries of `pages` the worker's row already has
    shared_pages: int = 0  # leading entries of `pages` owned by the radix tree (locked via node)
    node: Node | None = None  # deepest locked radix node
    # Window pool only (kv.py): window-pool page of each entry of `pages` (-1: dropped, out of
    # every future query's window); entries below `win_lo` are all -1 (dropped, or left to the
    # tree as cache); `win_from`: the tree nodes of its path from this page on are window-locked.
    win: list[int] = field(default_factory=list)
    win_lo: int = 0
    win_from: int = 0

    # Progress. KV positions [0, computed) are written or being written by launched steps.
    computed: int = 0
    target: int = 0  # tokens to prefill on this (re)start: prompt + outputs known at admission
    pending_samples: int = 0  # sampled tokens in launched steps not collected yet
    inflight: int = 0  # launched (or being planned) steps that reference this request
    kv_valid: bool = True  # False after a failed step: its pages must not enter the cache

    cached_tokens: int = -1  # prefix hit at first admission (-1: not admitted yet)

    @property
    def rank(self) -> tuple[int, int]:
        """Running order: priority, then arrival. The last running request is the first victim
        when memory runs short, so low priority is given up before young."""
        return (self.priority, self.arrival)

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def prefilling(self) -> bool:
        return self.computed < self.target

    @property
    def can_decode(self) -> bool:
        """A decode entry may be planned: prefill launched and more tokens are wanted."""
        return (
            self.phase is Phase.RUNNING
            and not self.prefilling
            and self.num_outputs + self.pending_samples < self.max_tokens
        )

    def restart_params(self) -> SamplingParams:
        """Sampling parameters for a (re)start in a slot. After preemption the worker only sees
        tokens sampled in the new slot, so outputs already made count toward min_tokens here."""
        params, done = self.params, self.num_outputs
        if done == 0 or params.min_tokens == 0:
            return params
        return replace(params, min_tokens=max(0, params.min_tokens - done),
                       max_tokens=max(1, params.max_tokens - done))


def take_token(req: Request, event: TokenEvent, out: StepOutput, i: int) -> FinishReason | None:
    """Entry `i` of a step's output is `req`'s next token: append it to the request and to the
    step's event; the reason the request ends with it, if it does."""
    token = out.token_ids[i]
    req.tokens.append(token)
    event.token_ids.append(token)
    params = req.params
    if params.logprobs and out.logprobs:
        event.logprobs.append(out.logprobs[i])
        if params.top_logprobs and out.top_logprobs:
            event.top_logprobs.append(out.top_logprobs[i])
    n = len(req.tokens) - req.prompt_len
    if token in req.stop_ids and n >= params.min_tokens:
        return FinishReason.STOP
    if n >= req.max_tokens:
        return FinishReason.LENGTH
    return None
