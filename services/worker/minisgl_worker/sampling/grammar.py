"""Constrained decoding in the worker: per-slot grammar matchers and the token mask they give.

Grammars come as `GrammarSpec`s on a request's SamplingParams and are compiled with llguidance
against the model's tokenizer (`tokenizer.json` of the model directory). A compiled grammar is a
template matcher cached by its spec; every request gets a `deep_copy` of it, so a schema is
compiled once however many requests use it. The cache is sized in bytes (an estimate: llguidance
reports none; see `template_bytes`), `--grammar-cache-mib`.

Compiling is off the step. `set_slot` (at admission, before the request's prefill forward is
queued) hands the compile to a small thread pool: a bounded compile (minisgl_core.grammar_limits:
parser limits, the first masks, the forced tokens fed) that also leaves the request's matcher with
its first mask computed. The row's first mask is needed only after that prefill forward, so the
compile runs while the GPU works. If it is still running then, `apply` waits for it, but never
past `--grammar-compile-timeout` from admission; a grammar that is over its bounds or over time
ends its request at once (EOS only, logged) instead of holding the batch. The gateway runs the same
bounded compile and answers 400, so such grammars reach the worker only through the internal API.

Per step, for the rows of the batch that have a grammar only:
  1. the tokens sampled for them in the previous step are read back (a wait on that step's event
     only; with overlap scheduling the current step's forward is already queued behind it) and
     fed to their matchers;
  2. the matchers fill an int32 bitmask on the host (llguidance, in its thread pool, without the
     GIL) while the GPU runs this step's forward;
  3. the bitmask is uploaded and the disallowed logits of those rows set to -inf.
A matcher that reached the end of its grammar allows only the EOS tokens, so the request stops
the ordinary way (its EOS is a stop token). Batches without grammar rows never reach this module.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import torch
from minisgl_core.grammar_limits import parser_limits, probe
from minisgl_core.sampling import GrammarSpec

from .grammar_mask import apply_bitmask
from .upload import upload

if TYPE_CHECKING:  # imported when first needed: a worker without llguidance serves the rest
    import llguidance
    from llguidance._lib import JsonCompileOptions

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 256 << 20  # compiled templates kept (each request deep-copies one)
DEFAULT_COMPILE_TIMEOUT = 0.2  # s from admission to the first mask, past it the request ends
COMPILE_THREADS = 2  # grammars compiling at once; the rest queue behind them


class Matcher(Protocol):
    """What this module uses of `llguidance.LLMatcher` (and of `_EosOnly`)."""

    def is_stopped(self) -> bool: ...
    def is_error(self) -> bool: ...
    def consume_token(self, sampled_token: int) -> bool: ...
    def consume_tokens(self, sampled_tokens: list[int]) -> bool: ...


class GrammarError(ValueError):
    """A grammar does not compile; the message names the problem."""


def grammar_text(spec: GrammarSpec) -> str:
    """The spec in llguidance's grammar format (no tokenizer needed)."""
    import llguidance

    # Fixed separators (", " and ": "), no free whitespace: a weak model cannot loop on blanks.
    options: JsonCompileOptions = {"whitespace_flexible": False}
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.spec, overrides=options)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             overrides=options)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.spec)
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


def find_tokenizer(model_path: str) -> str | None:
    path = Path(model_path) / "tokenizer.json"
    return str(path) if path.is_file() else None


class GrammarCompiler:
    """Tokenizer-bound compilation with a cache. The llguidance tokenizer is built on first use,
    so servers that never see a grammar pay nothing."""

    def __init__(self, tokenizer_path: str | None, vocab_size: int,
                 eos_token_ids: Sequence[int], cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_bytes = cache_bytes
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._cache: OrderedDict[GrammarSpec, tuple[llguidance.LLMatcher, int]] = OrderedDict()
        self.cached_bytes = 0
        self._lock = threading.Lock()  # the tokenizer
        self._cache_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def warm(self) -> None:
        """Build the llguidance tokenizer in a background thread (slow for a large vocabulary),
        so the first grammar request does not stall a step for it."""
        def build() -> None:
            try:
                self._tok()
            except Exception as exc:  # reported again to the first request with a grammar
                log.warning("grammar support unavailable: %r", exc)

        if self.tokenizer_path is not None:
            threading.Thread(target=build, name="grammar-tokenizer", daemon=True).start()

    def _tok(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                if self.tokenizer_path is None:
                    raise GrammarError("this model has no tokenizer.json: grammars are "
                                       "unavailable")
                self._tokenizer = llguidance.LLTokenizer(
                    self.tokenizer_path, n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None)
                self._executor = llguidance.LLExecutor(max(1, min(8, (os.cpu_count() or 2) // 2)))
            return self._tokenizer

    @property
    def executor(self) -> llguidance.LLExecutor:
        self._tok()
        assert self._executor is not None
        return self._executor

    def template_bytes(self, text: str) -> int:
        """Estimated host memory of one compiled template: llguidance reports none. A template
        holds tables over the vocabulary and the grammar's symbols, and its lexer grows with the
        states built (bounded by the parser limits); the estimate is a fixed part, a part per
        vocabulary token and one per character of grammar text, sized from the resident memory
        of many compiled schemas."""
        return (64 << 10) + 16 * self.vocab_size + 64 * len(text)

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher for `spec`, its first mask computed; raises GrammarError (also for a
        grammar past the bounds of minisgl_core.grammar_limits). Thread-safe."""
        with self._cache_lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
        if hit is None:
            import llguidance

            try:
                text = grammar_text(spec)
            except ValueError as exc:
                raise GrammarError(str(exc)) from None
            template = llguidance.LLMatcher(self._tok(), text, log_level=0,
                                            limits=parser_limits())
            error = template.get_error() if template.is_error() else probe(template.deep_copy())
            if error:
                raise GrammarError(error.strip().splitlines()[0])
            self._remember(spec, template, self.template_bytes(text))
        else:
            template = hit[0]
        matcher = template.deep_copy()
        matcher.compute_bitmask()  # the first mask, here rather than in the step
        return matcher

    def _remember(self, spec: GrammarSpec, template: llguidance.LLMatcher, size: int) -> None:
        """Caches `template`, dropping the least recently used past the byte budget (a template
        larger than the whole budget is used once and not kept)."""
        if size > self.cache_bytes:
            return
        with self._cache_lock:
            old = self._cache.pop(spec, None)
            if old is not None:
                self.cached_bytes -= old[1]
            self._cache[spec] = (template, size)
            self.cached_bytes += size
            while self.cached_bytes > self.cache_bytes:
                _, (_, dropped) = self._cache.popitem(last=False)
                self.cached_bytes -= dropped

    def submit(self, spec: GrammarSpec) -> Future[llguidance.LLMatcher]:
        """`matcher(spec)` in the compile threads."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        return self._pool.submit(self.matcher, spec)


@dataclass(slots=True)
class _Pending:
    """Tokens sampled for grammar rows, on their way to the host."""

    matchers: list[Matcher]
    tokens: torch.Tensor  # host (pinned on CUDA), filled when `event` completes
    event: torch.cuda.Event | None


class SlotGrammars:
    """The matchers of the slots whose request has a grammar."""

    def __init__(self, max_slots: int, vocab_size: int, device: torch.device,
                 compiler: GrammarCompiler,
                 compile_timeout: float = DEFAULT_COMPILE_TIMEOUT) -> None:
        self.vocab_size, self.device, self.compiler = vocab_size, device, compiler
        self.compile_timeout = compile_timeout
        self.active = np.zeros(max_slots, dtype=bool)
        self.n_active = 0
        self._matchers: list[Matcher | _Compiling | None] = [None] * max_slots
        self._prompt_len = [0] * max_slots
        self._pending: list[_Pending] = []
        self.words = -(-vocab_size // 32)
        self.use_triton: bool | None = None  # None: on CUDA devices (grammar_mask.py)
        self._rows_matchers: list[Matcher] = []  # of the last `apply`, for `record`
        self._bufs: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_slot(self, slot: int, spec: GrammarSpec | None, prompt_len: int) -> None:
        matcher: Matcher | _Compiling | None = None
        if spec is not None:
            matcher = _Compiling(self.compiler.submit(spec),
                                 time.monotonic() + self.compile_timeout)
        if self.active[slot]:
            self.n_active -= 1
        self._matchers[slot] = matcher
        self.active[slot] = matcher is not None
        self.n_active += int(matcher is not None)
        self._prompt_len[slot] = prompt_len

    def _ready(self, slot: int) -> Matcher | None:
        """The slot's matcher, waiting for its compile (until its deadline) if need be."""
        m = self._matchers[slot]
        if not isinstance(m, _Compiling):
            return m
        try:
            matcher: Matcher = m.future.result(timeout=max(0.0, m.deadline - time.monotonic()))
        except FutureTimeout:
            # The compile goes on in its thread (it cannot be interrupted) and is then dropped.
            log.warning("grammar of slot %d did not compile within %.3f s: the request ends",
                        slot, self.compile_timeout)
            matcher = _EosOnly()
        except ImportError:
            log.warning("a request has a grammar but llguidance is not installed")
            matcher = _EosOnly()
        except GrammarError as exc:
            # The gateway validated it; a tokenizer-specific failure (or one over the bounds)
            # ends the request at once (EOS only) instead of failing the whole step.
            log.warning("grammar failed to compile for slot %d: %s", slot, exc)
            matcher = _EosOnly()
        self._matchers[slot] = matcher
        return matcher

    def observe(self, slot: int, token_ids: Sequence[int], start_pos: int) -> None:
        """Inputs at positions past the prompt are earlier outputs being recomputed (after a
        preemption): the matcher must have consumed them."""
        if self._matchers[slot] is None:
            return
        outputs = list(token_ids[max(0, self._prompt_len[slot] - start_pos):])
        if outputs:
            matcher = self._ready(slot)
            assert matcher is not None
            matcher.consume_tokens(outputs)

    def _drain(self) -> None:
        for p in self._pending:
            if p.event is not None:
                p.event.synchronize()
            for m, t in zip(p.matchers, p.tokens.tolist(), strict=True):
                if not m.is_stopped():
                    m.consume_token(t)
        self._pending.clear()

    def apply(self, x: torch.Tensor, host_slots: np.ndarray) -> torch.Tensor | None:
        """Mask the grammar rows of logits `x` [B, V] (any float dtype) in place; returns the
        device row indices that were masked (None: no grammar row in this batch)."""
        rows = np.flatnonzero(self.active[host_slots])
        if rows.size == 0:
            return None
        self._drain()
        matchers = [m for m in (self._ready(int(s)) for s in host_slots[rows])
                    if m is not None]  # every active slot has one
        host, dev = self._buffers()
        bitmask = host.numpy()[: rows.size]
        real = [(cast("llguidance.LLMatcher", m), i) for i, m in enumerate(matchers)
                if not isinstance(m, _EosOnly)]
        if real:
            import llguidance.numpy as lnp

            lnp.fill_next_token_bitmask_par(self.compiler.executor, real, bitmask)
        for i, m in enumerate(matchers):
            if isinstance(m, _EosOnly) or m.is_error():
                bitmask[i] = 0
                words = bitmask.view(np.uint32)
                for t in self.compiler.eos_token_ids:
                    words[i, t // 32] |= np.uint32(1 << (t % 32))
        # The host buffer is reused next step: by then this copy is done (the next `apply`
        # first waits for this step's tokens, drawn after the mask was applied).
        bits = dev[: rows.size]
        bits.copy_(host[: rows.size], non_blocking=True)
        idx = upload(torch.from_numpy(rows.astype(np.int64)), self.device)
        apply_bitmask(x, idx, bits, self.use_triton)
        self._rows_matchers = matchers
        return idx

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Host (pinned on CUDA) and device bitmask buffers for every slot, made on first use."""
        if self._bufs is None:
            shape = (len(self._matchers), self.words)
            host = torch.zeros(shape, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._bufs = (host, torch.zeros(shape, dtype=torch.int32, device=self.device))
        return self._bufs

    def record(self, idx: torch.Tensor, tokens: torch.Tensor) -> None:
        """The tokens just drawn for the rows `apply` masked: copied to the host behind an event;
        the next `apply` feeds them to the matchers."""
        picked = tokens[idx]
        event = None
        if self.device.type == "cuda":
            host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
            host.copy_(picked, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = picked.clone()
        self._pending.append(_Pending(self._rows_matchers, host, event))


@dataclass(slots=True)
class _Compiling:
    """A slot whose grammar is compiling in the background; `deadline` is time.monotonic()."""

    future: Future[llguidance.LLMatcher]
    deadline: float


class _EosOnly:
    """Stands in for a matcher whose grammar failed to compile: the request ends at once."""

    def is_stopped(self) -> bool:
        return True

    def is_error(self) -> bool:
        return True

    def consume_token(self, token: int) -> bool:
        return False

    def consume_tokens(self, tokens: list[int]) -> bool:
        return False
