"""A deterministic stand-in for the GPU worker (the one legitimate fake in these tests).

It keeps a real paged KV store: every input token at position p writes `(p, h_p, token)` into the page
its slot's page table maps p to, where `h_p = mix(h_{p-1}, token)` chains the whole prefix. A token is
sampled from the chain value it computed, so the output depends on exactly the KV the plan made
visible: a wrong page table, a page freed and reused too early, or a prefix-cache page with the
wrong content changes the tokens, and `reference()` (no paging at all) no longer agrees.

Reads of a step happen before its writes, as in a real batched forward: a request may not read KV
that another request of the same step is writing.

With `window_pages` > 0 it is a worker with a sliding-window pool: every token is also written
through the slot's window-page row, and each entry checks that the window pages of the `window - 1`
positions before its first input hold exactly those positions' KV (a window page dropped and
reused too early, or a stale one, fails the step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minisgl_core.sampling import SamplingParams
from minisgl_core.step import ReqPlan, StepExecutor, StepOutput, StepPlan, TopLogprobs, WorkerInfo

MASK = (1 << 64) - 1
SEED = 0x9E3779B97F4A7C15


def mix(h: int, token: int) -> int:
    z = (h + token * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


class FakeError(AssertionError):
    """The plan broke the scheduler -> worker contract."""


@dataclass
class _Slot:
    row: list[int] = field(default_factory=list)
    wrow: list[int] = field(default_factory=list)  # window-pool pages (-1: none)
    last: int | None = None  # token sampled by the latest sampling step (the decode future)
    params: SamplingParams | None = None


class FakeExecutor(StepExecutor):
    def __init__(self, num_pages: int = 64, page_size: int = 4, max_slots: int = 16,
                 max_model_len: int = 4096, vocab_size: int = 1000, eos_id: int = 2,
                 eos_every: int = 0, paranoid: bool = True, fail_at_step: int | None = None,
                 window_pages: int = 0, window: int = 0) -> None:
        self._info = WorkerInfo(
            model_name="fake", num_pages=num_pages, page_size=page_size,
            max_model_len=max_model_len, max_slots=max_slots, vocab_size=vocab_size,
            eos_token_ids=[eos_id],
            device="fake",  # not a CPU worker: the scheduler's CPU defaults (step pacing) stay off
            window_pages=window_pages, window=window if window_pages else 0,
        )
        self.wkv: list[tuple[int, int, int] | None] = [None] * (window_pages * page_size)
        self.window_reads = 0  # cached window positions checked
        self.eos_every = eos_every  # ~1 in eos_every samples is EOS (0: never)
        self.paranoid = paranoid  # re-verify each request's whole chain every step
        self.fail_at_step = fail_at_step  # this step and every later one fail
        self.fail_steps: set[int] = set()  # these steps fail (once each)
        self.kv: list[tuple[int, int, int] | None] = [None] * (num_pages * page_size)
        self.slots = [_Slot() for _ in range(max_slots)]
        self.results: deque[StepOutput | Exception] = deque()
        self.plans: list[StepPlan] = []
        self.max_inflight_seen = 0
        self.closed = False

    def info(self) -> WorkerInfo:
        return self._info

    def launch(self, plan: StepPlan) -> None:
        self.plans.append(plan)
        out = self._run(plan)  # an injected failure still computes: only the answer is lost
        failing = self.fail_at_step is not None and plan.step_id >= self.fail_at_step
        if failing or plan.step_id in self.fail_steps:
            self.results.append(RuntimeError(f"injected failure at step {plan.step_id}"))
        else:
            self.results.append(out)
        self.max_inflight_seen = max(self.max_inflight_seen, len(self.results))
        if len(self.results) > 2:
            raise FakeError("more than two steps in flight")

    def collect(self) -> StepOutput:
        if not self.results:
            raise FakeError("collect without a launched step")
        result = self.results.popleft()
        if isinstance(result, Exception):
            raise result
        return result

    def close(self) -> None:
        self.closed = True

    # -- the "forward pass" ---------------------------------------------------------------------

    def _loc(self, row: list[int], pos: int) -> int:
        ps = self._info.page_size
        if pos // ps >= len(row):
            raise FakeError(f"position {pos} has no page (row of {len(row)} pages)")
        page = row[pos // ps]
        if not 0 <= page < self._info.num_pages:
            raise FakeError(f"page {page} out of range")
        return page * ps + pos % ps

    def _wloc(self, wrow: list[int], pos: int) -> int:
        ps = self._info.page_size
        page = wrow[pos // ps] if pos // ps < len(wrow) else -1
        if not 0 <= page < self._info.window_pages:
            raise FakeError(f"position {pos} has no window page ({page})")
        return page * ps + pos % ps

    def _check_window(self, slot: _Slot, cache_len: int) -> None:
        """The first query at cache_len reads positions cache_len - window + 1 .. cache_len - 1
        of the window pool: each must hold that position's KV, as the full pool does."""
        for pos in range(max(0, cache_len - self._info.window + 1), cache_len):
            got = self.wkv[self._wloc(slot.wrow, pos)]
            if got is None or got != self.kv[self._loc(slot.row, pos)]:
                raise FakeError(f"window KV at position {pos} is stale or from another position")
            self.window_reads += 1

    def _chain(self, row: list[int], length: int) -> int:
        """h_{length-1} as stored; verifies positions (and the whole chain when paranoid)."""
        if length == 0:
            return SEED
        if not self.paranoid:
            entry = self.kv[self._loc(row, length - 1)]
            if entry is None or entry[0] != length - 1:
                raise FakeError(f"KV at position {length - 1} missing or from another position")
            return entry[1]
        h = SEED
        for pos in range(length):
            entry = self.kv[self._loc(row, pos)]
            if entry is None or entry[0] != pos or entry[1] != mix(h, entry[2]):
                raise FakeError(f"KV chain broken at position {pos}")
            h = entry[1]
        return h

    def _run(self, plan: StepPlan) -> StepOutput:
        slots_seen: set[int] = set()
        work = []
        for entry in entries(plan):  # read phase
            if entry.slot in slots_seen or not 0 <= entry.slot < len(self.slots):
                raise FakeError(f"slot {entry.slot} twice in one step or out of range")
            slots_seen.add(entry.slot)
            slot = self.slots[entry.slot]
            if entry.sampling is not None:
                if entry.page_offset != 0:
                    raise FakeError("a (re)start must send its page row from offset 0")
                self.slots[entry.slot] = slot = _Slot(params=entry.sampling)
            elif slot.params is None:
                raise FakeError(f"slot {entry.slot} used before a start")
            if entry.page_offset > len(slot.row):
                raise FakeError("page_offset leaves a hole in the page table")
            slot.row[entry.page_offset : entry.page_offset + len(entry.new_pages)] = entry.new_pages
            if self._info.window_pages:
                if len(entry.new_window_pages) != len(entry.new_pages):
                    raise FakeError("window pages not aligned with new_pages")
                slot.wrow[entry.page_offset:entry.page_offset + len(entry.new_pages)] = \
                    entry.new_window_pages
                self._check_window(slot, entry.cache_len)
            elif entry.new_window_pages:
                raise FakeError("window pages sent to a worker without a window pool")
            if entry.input_ids:
                inputs = list(entry.input_ids)
            elif slot.last is None:
                raise FakeError(f"decode in slot {entry.slot} without a sampled token")
            else:
                inputs = [slot.last]
            work.append((entry, slot, inputs, self._chain(slot.row, entry.cache_len)))
        writes: set[int] = set()
        out = StepOutput(step_id=plan.step_id)
        want_logprobs = any(s.params is not None and s.params.logprobs for _, s, _, _ in work)
        for entry, slot, inputs, h in work:  # write phase
            for i, token in enumerate(inputs):
                pos = entry.cache_len + i
                loc = self._loc(slot.row, pos)
                if loc in writes:
                    raise FakeError(f"two requests write KV location {loc} in one step")
                writes.add(loc)
                h = mix(h, token)
                self.kv[loc] = (pos, h, token)
                if self._info.window_pages:
                    wloc = self._wloc(slot.wrow, pos)
                    if -1 - wloc in writes:
                        raise FakeError(f"two requests write window location {wloc} in one step")
                    writes.add(-1 - wloc)
                    self.wkv[wloc] = (pos, h, token)
            if not entry.sample:
                slot.last = None
                continue
            token = sample(h, self._info.vocab_size, self._info.eos_token_ids[0], self.eos_every)
            slot.last = token
            out.rids.append(entry.rid)
            out.token_ids.append(token)
            if want_logprobs:
                out.logprobs.append(-(h % 1000) / 100.0)
                out.top_logprobs.append(TopLogprobs([token, (token + 1) % 7], [-0.1, -2.0]))
        return out


def entries(plan: StepPlan) -> list[ReqPlan]:
    """The step's entries in row order, a decode as a ReqPlan without inputs."""
    d = plan.decodes
    if not d.consistent():
        raise FakeError("decode columns of different lengths")
    rows, at = [], 0
    for i, rid in enumerate(d.rids):
        n = d.new_page_counts[i]
        rows.append(ReqPlan(rid, d.slots[i], d.cache_lens[i], [], d.page_offsets[i],
                            d.new_pages[at:at + n],
                            new_window_pages=d.new_window_pages[at:at + n]))
        at += n
    for r in plan.reqs:
        if not r.input_ids:
            raise FakeError("a prefill chunk without input_ids")
    return rows + plan.reqs


def sample(h: int, vocab_size: int, eos_id: int, eos_every: int) -> int:
    if eos_every and (h >> 17) % eos_every == 0:
        return eos_id
    token = (h >> 23) % vocab_size
    return token if token != eos_id else (token + 1) % vocab_size


def reference(prompt: list[int], params: SamplingParams, fake: FakeExecutor) -> list[int]:
    """The tokens an unpaged, unbatched, uncached run produces (what every schedule must match)."""
    info = fake.info()
    h = SEED
    for t in prompt:
        h = mix(h, t)
    max_tokens = min(params.max_tokens, info.max_model_len - len(prompt))
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(info.eos_token_ids))
    out: list[int] = []
    while True:
        token = sample(h, info.vocab_size, info.eos_token_ids[0], fake.eos_every)
        out.append(token)
        if (token in stop and len(out) >= params.min_tokens) or len(out) >= max_tokens:
            return out
        h = mix(h, token)
