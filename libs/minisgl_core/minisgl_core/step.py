"""The scheduler -> worker contract as plain dataclasses (mirrors `minisgl.v1` worker messages).

One `StepPlan` per scheduler step carries every request of the batch; one `StepOutput` comes back.
The scheduler owns pages and slots; the worker owns the tensors they index:

* `slot` is a row of the worker's per-request state (page table, last sampled token, penalty
  counts, RNG seed). The scheduler hands slots out and reuses them after a request ends.
* `new_pages` are written into the slot's page-table row starting at `page_offset`; earlier entries
  stay as they were. A request (re)starting in a slot sends its full page list with offset 0.
* Positions of the inputs are `cache_len, cache_len + 1, ...`; the KV of the first `cache_len`
  tokens is already in the slot's pages (prefix-cache hit or earlier chunks).
* A worker with a window pool (`WorkerInfo.window_pages` > 0: sliding-window layers keep their KV
  in a second, smaller pool) gets `new_window_pages` aligned with `new_pages`: entry i is the
  window-pool page of the same logical page, or -1 where none is kept (outside every window, so
  never read). Without a window pool the lists are empty and the messages are as before.

A step has two kinds of entries, in two layouts (as vLLM v1's `SchedulerOutput` splits new from
cached requests), because they differ in volume and in what they carry:

* decodes, `StepPlan.decodes`: one token per request, the token the worker sampled for this slot
  in an earlier step (a token future), so the scheduler can send step N+1 before step N's tokens
  came back (overlap scheduling). They are most of every step and carry only numbers, so they
  travel as columns (`DecodeEntries`) from the scheduler's planning loop through the wire to the
  worker's numpy plan builder, never as one object per request.
* prefill chunks, `StepPlan.reqs`: a `ReqPlan` per request that (re)starts in its slot or sends
  more prompt tokens; few per step, with token lists and sampling parameters.

The step's rows are the decodes in order, then `reqs` in order; `StepOutput` answers the entries
that sample in that order (every decode samples).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl_core.sampling import SamplingParams


@dataclass(slots=True)
class DecodeEntries:
    """Decode entries in columns: entry i is request `rids[i]` in slot `slots[i]`, its input at
    position `cache_lens[i]`; the next `new_page_counts[i]` ids of the flat `new_pages` go into
    the slot's page-table row from `page_offsets[i]` on. Every entry samples."""

    rids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    cache_lens: list[int] = field(default_factory=list)
    page_offsets: list[int] = field(default_factory=list)
    new_page_counts: list[int] = field(default_factory=list)
    new_pages: list[int] = field(default_factory=list)
    # Window pool (WorkerInfo.window_pages > 0): aligned with new_pages; else empty.
    new_window_pages: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rids)

    def add(self, rid: int, slot: int, cache_len: int, page_offset: int = 0,
            new_pages: list[int] | None = None,
            new_window_pages: list[int] | None = None) -> None:
        """One entry (tests and small callers; the scheduler appends to the columns itself)."""
        self.rids.append(rid)
        self.slots.append(slot)
        self.cache_lens.append(cache_len)
        self.page_offsets.append(page_offset)
        self.new_page_counts.append(len(new_pages) if new_pages else 0)
        if new_pages:
            self.new_pages.extend(new_pages)
        if new_window_pages:
            self.new_window_pages.extend(new_window_pages)

    def consistent(self) -> bool:
        """Columns of one length, and page counts >= 0 that add up to the flat page list."""
        counts = self.new_page_counts
        return (len(self.slots) == len(self.cache_lens) == len(self.page_offsets) == len(counts)
                == len(self.rids) and sum(counts) == len(self.new_pages)
                and min(counts, default=0) >= 0
                and len(self.new_window_pages) in (0, len(self.new_pages)))


@dataclass(slots=True)
class ReqPlan:
    """A prefill chunk: `input_ids` at positions cache_len, cache_len + 1, ... (never empty)."""

    rid: int
    slot: int
    cache_len: int
    input_ids: list[int]
    page_offset: int = 0
    new_pages: list[int] = field(default_factory=list)
    sample: bool = True  # False for a non-final prefill chunk
    # Set when the request (re)starts in this slot; the worker keeps it per slot until then.
    sampling: SamplingParams | None = None
    # Tokens already in the KV cache that the worker has not seen in this slot (prefix hits,
    # recomputation after preemption): sent on (re)start only when penalties need the history.
    history_ids: list[int] = field(default_factory=list)
    # On (re)start: the original prompt's length; later positions of history_ids / input_ids are
    # outputs from before a preemption (presence/frequency penalties count them). 0: unknown.
    num_prompt_tokens: int = 0
    # On (re)start, while the scheduler logs or traces requests: the client's x-request-id.
    request_id: str = ""
    # Window pool only: aligned with new_pages (-1: no window page kept for that logical page).
    new_window_pages: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    step_id: int
    reqs: list[ReqPlan] = field(default_factory=list)  # prefill chunks, after the decodes
    decodes: DecodeEntries = field(default_factory=DecodeEntries)
    # Traceparents of the traced prefill chunks in this step (usually none): the worker's span.
    traceparents: list[str] = field(default_factory=list)

    @property
    def num_entries(self) -> int:
        """Requests in the step (rows of the batch)."""
        return len(self.decodes.rids) + len(self.reqs)


@dataclass(slots=True)
class TopLogprobs:
    token_ids: list[int]
    logprobs: list[float]


@dataclass(slots=True)
class StepOutput:
    """Columnar: entry i belongs to rids[i]; only requests with `sample=True` appear."""

    step_id: int
    rids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # empty unless some request asked
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # aligned with rids when used
    forward_ms: float = 0.0
    # How the worker ran the step: "cuda_graph" (a captured decode step), "piecewise" (a prefill
    # or mixed step replayed in pieces between eager attention calls) or "eager"; "" unknown.
    # In-process only (the worker's metrics): the wire format does not carry it.
    graph: str = ""


@dataclass(slots=True)
class WorkerInfo:
    model_name: str
    num_pages: int
    page_size: int
    max_model_len: int
    max_slots: int  # rows of the page table: the most requests one step can hold
    vocab_size: int
    eos_token_ids: list[int]
    tp_size: int = 1
    device: str = "cpu"
    attention_backend: str = "torch"
    kv_cache_dtype: str = ""  # "bfloat16", "float8_e4m3fn", ... ("" from an older worker)
    # The worker process's identity, random per start (0: unknown, an older worker or an
    # in-process engine). Another value later means a restarted worker with an empty KV cache.
    epoch: int = 0
    # TP: the largest step (tokens) whose all-reduces stay on the fused two-shot kernel; longer
    # ones take NCCL. 0: none, or unknown (one GPU, an older worker).
    two_shot_max_tokens: int = 0
    # Sliding-window layers keep their KV in a second pool of this many pages (same page size),
    # indexed through a second page table (0: no window pool, every layer in the main pool).
    window_pages: int = 0
    # The largest sliding window (tokens) of those layers: KV of a position more than
    # window - 1 before every future query of a request is dropped from the window pool.
    window: int = 0


class StepExecutor:
    """What the scheduler drives: the in-process engine or the gRPC client of a worker.

    `launch` must not block on the step's result; `collect` returns outputs in launch order.
    At most two steps are in flight with overlap scheduling on, one with it off.
    """

    def info(self) -> WorkerInfo:
        raise NotImplementedError

    def launch(self, plan: StepPlan) -> None:
        raise NotImplementedError

    def collect(self) -> StepOutput:
        raise NotImplementedError

    def check_worker(self) -> WorkerInfo | None:
        """Between steps: the new info when the executor now drives another worker process (its
        KV cache is empty), else None. An in-process engine never changes."""
        return None

    def close(self) -> None:
        """Release resources; idempotent."""
