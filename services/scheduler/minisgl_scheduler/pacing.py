"""The prompt-token budget of a step, sized by measured step time (issue #55 item 10).

Every running stream waits for the whole step that carries its next token, so a step full of
prefill (8,192 prompt tokens by default) pauses every decode stream for as long as it takes: on a
CPU that is seconds. With a latency target, the scheduler caps the prompt tokens of the next step
at what the worker's recent steps say fits in that time: chunked prefill then spreads a long
prompt over several short steps and decode tokens keep flowing between them.

The cost model is fitted to the worker's own step times (`StepOutput.forward_ms`):

    time = base + a * tokens + b * pairs

`base` is a step without prompt tokens (its decode rows and fixed costs, from decode-only steps);
`tokens` the step's prompt tokens (the projections and MLPs, linear in them) and `pairs` the
(query, key) pairs their attention reads, sum of n * (start + n / 2) over its chunks, which makes
a chunk deep in a long prompt dearer than one at its start. `a` and `b` are a least-squares fit
over recent prefill steps, older ones weighing less, so the budget follows the batches and the
machine's load. Until a prefill step has been measured the budget is a modest probe, and it grows
by at most MAX_GROWTH a step over the chunks measured: the model is trusted only near the sizes
it was fitted on. A worker that does not time its steps (`forward_ms == 0` on a prefill step)
turns pacing off, and without a target the budget is `max_prefill_tokens`, as before.
"""

from __future__ import annotations

import math

CPU_DEFAULT_STEP_MS = 200.0  # the target when the flag says auto and the worker runs on a CPU
MIN_CHUNK_TOKENS = 64  # a chunk never shrinks below this: long prompts still make progress
PROBE_TOKENS = 256  # the budget before any prefill step was measured
MIN_MEASURED_TOKENS = 32  # fewer prompt tokens than this say little about their cost
MAX_GROWTH = 1.5  # a budget is at most this many times the largest chunk measured lately
FORGET = 0.8  # weight of a prefill step in the fit, per newer prefill step
BASE_ALPHA = 0.3  # weight of the newest decode-only step in `base`
HEADROOM = 0.85  # aim under the target: step times are noisy and the model is a fit


def resolve_target(max_step_ms: float, device: str) -> float:
    """The target in ms (0: off) for the flag's value: < 0 means auto, the CPU default on a CPU
    worker and off on accelerators (whose prefill steps are short and whose throughput needs
    full steps)."""
    if max_step_ms >= 0:
        return max_step_ms
    return CPU_DEFAULT_STEP_MS if device.startswith("cpu") else 0.0


def attention_pairs(chunks: list[tuple[int, int]]) -> float:
    """(query, key) pairs of prefill chunks given as (start position, tokens)."""
    return sum(n * (start + n / 2) for start, n in chunks)


class PrefillPacer:
    def __init__(self, target_ms: float, max_tokens: int) -> None:
        self.target_ms = target_ms
        self.max_tokens = max_tokens
        self.base_ms = 0.0  # a step without prompt tokens (0 until one was measured)
        self.a = 0.0  # ms per prompt token
        self.b = 0.0  # ms per attention pair
        self.measured_tokens = 0  # the largest recent prefill step (0: none measured yet)
        # Decayed sums of the normal equations of the fit: x = (tokens, pairs), y = ms - base.
        self._xx = [0.0, 0.0, 0.0]  # sum t*t, t*p, p*p
        self._xy = [0.0, 0.0]  # sum t*y, p*y

    @property
    def enabled(self) -> bool:
        return self.target_ms > 0

    def budget(self, start: int = 0) -> int:
        """Prompt tokens the next step may carry, its chunk starting at position `start`."""
        if self.target_ms <= 0:
            return self.max_tokens
        if not self.measured_tokens:
            return min(self.max_tokens, PROBE_TOKENS)
        room = self.target_ms * HEADROOM - self.base_ms
        # Largest n with a * n + b * n * (start + n / 2) <= room.
        lin = self.a + self.b * start
        if room <= 0:
            fit = 0
        elif self.b > 0:
            fit = math.floor((math.sqrt(lin * lin + 2 * self.b * room) - lin) / self.b)
        elif lin > 0:
            fit = math.floor(room / lin)
        else:
            fit = self.max_tokens
        fit = min(fit, math.floor(self.measured_tokens * MAX_GROWTH))
        return max(MIN_CHUNK_TOKENS, min(self.max_tokens, fit))

    def observe(self, tokens: int, pairs: float, forward_ms: float) -> None:
        """A collected step: its prompt tokens, their attention pairs, the worker's time."""
        if self.target_ms <= 0:
            return
        if forward_ms <= 0:
            if tokens:
                self.target_ms = 0.0  # an untimed worker: nothing to size steps by
            return
        if tokens == 0:
            old = self.base_ms
            self.base_ms = forward_ms if not old else old + BASE_ALPHA * (forward_ms - old)
            return
        if tokens < MIN_MEASURED_TOKENS:
            return
        y = max(0.0, forward_ms - self.base_ms)
        xx, xy = self._xx, self._xy
        for i, v in enumerate((tokens * tokens, tokens * pairs, pairs * pairs)):
            xx[i] = xx[i] * FORGET + v
        for i, v in enumerate((tokens * y, pairs * y)):
            xy[i] = xy[i] * FORGET + v
        # Forgets old large chunks slowly, so that the budget can also shrink for good.
        self.measured_tokens = max(tokens, int(self.measured_tokens * 0.9))
        self._solve()

    def _solve(self) -> None:
        (tt, tp, pp), (ty, py) = self._xx, self._xy
        det = tt * pp - tp * tp
        if det > 1e-9 * tt * pp:
            a, b = (ty * pp - py * tp) / det, (py * tt - ty * tp) / det
            if a >= 0 and b >= 0:
                self.a, self.b = a, b
                return
        # Too few distinct steps, or a fit with a negative cost: the better of the one-term fits
        # (all of it per token, or all of it per pair), by residual.
        a_only = ty / tt if tt > 0 else 0.0
        b_only = py / pp if pp > 0 else 0.0
        err_a = -a_only * ty  # residual sum of squares minus the common sum of y*y
        err_b = -b_only * py
        self.a, self.b = (a_only, 0.0) if err_a <= err_b else (0.0, b_only)
