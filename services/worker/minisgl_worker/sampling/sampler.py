"""Batched sampling on the device, with per-slot parameters and penalty state.

Per-request parameters live in device tensors indexed by slot, one named view per parameter of
two packed tables (params.py, state.py); `set_slot` writes a host mirror and marks the slot dirty,
and the next `sample` uploads every dirty row at once (a few copies per step rather than a dozen
tiny ones per request). The hot path is whole-batch tensor ops: no Python loop over requests and
no device->host read. Which processors run is decided on the host from the mirror (plan.py: a
batch without top-p never sorts; one without penalties never reads the count tensors).

Order of processing, per row: repetition penalty (HF, prompt + output tokens) -> presence and
frequency penalties (OpenAI, output tokens only) -> stop tokens masked until min_tokens ->
greedy argmax, or temperature -> top-k -> top-p -> min-p -> exponential race with hash noise
keyed by (seed, position, token) (see `ops`). A request without a seed gets one drawn
from the sampler's global generator when it (re)starts, so it is random across requests but each
draw is still one formula.

Logits may come in the model's dtype (bf16/fp16) or fp32. A batch whose rows are only greedy or
temperature-only (no processor above, no logprobs) is drawn in one pass over them: argmax, or the
same exponential race with the temperature applied inside the draw (`ops.gumbel_argmax` with
`temps`), bit for bit what converting to fp32, dividing and drawing gives. Only batches that need
processed fp32 logits pay for the full-vocabulary conversion. Such a batch (`shardable`) can also
be drawn at TP > 1 from each rank's vocabulary shard (`sample_sharded`, sharded.py).

Logprobs follow vLLM's default: the log-softmax of the raw model logits, before penalties,
temperature and filtering (the processed distribution is ill-defined for greedy rows and
truncated tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from minisgl_core.sampling import SamplingParams

from . import ops
from .grammar import DEFAULT_CACHE_BYTES, DEFAULT_COMPILE_TIMEOUT, GrammarCompiler, SlotGrammars
from .logit_bias import SlotBiases
from .params import ParamRow
from .penalties import NO_PROMPT_END, SlotPenalties
from .plan import SamplingPlan
from .sharded import Combine, VocabShard, shard_best
from .state import SlotState


@dataclass(slots=True)
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32, when some request asked
    top_ids: torch.Tensor | None = None  # [B, K] int64, K = max top_logprobs of the batch
    top_logprobs: torch.Tensor | None = None  # [B, K] float32, sorted descending


class Sampler:
    def __init__(self, max_slots: int, vocab_size: int, device: torch.device,
                 eos_token_ids: Sequence[int] = (), seed: int | None = None,
                 use_triton: bool | None = None, tokenizer_path: str | None = None,
                 grammar_cache_bytes: int = DEFAULT_CACHE_BYTES,
                 grammar_compile_timeout: float = DEFAULT_COMPILE_TIMEOUT) -> None:
        """`use_triton`: draw with the fused Triton kernel (default: on CUDA devices; True on CPU
        needs TRITON_INTERPRET=1, for tests); torch ops otherwise. `tokenizer_path`: the model's
        tokenizer.json, which grammars (structured outputs) are compiled against; compiled
        grammars are cached up to `grammar_cache_bytes` (estimated), and a request whose grammar
        is not compiled `grammar_compile_timeout` s after its `set_slot` ends (grammar.py)."""
        self.max_slots, self.vocab_size, self.device = max_slots, vocab_size, torch.device(device)
        self.use_triton = self.device.type == "cuda" if use_triton is None else use_triton
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._check_ids(self.eos_token_ids, "eos_token_ids")
        self._gen = torch.Generator()
        if seed is None:
            self._gen.seed()
        else:
            self._gen.manual_seed(seed)
        # Parameters, stop ids and output lengths per slot (state.py); penalty tables
        # (penalties.py). An unset slot is a plain greedy one.
        self.slots = SlotState(max_slots, self.device)
        self.penalties = SlotPenalties(max_slots, vocab_size, self.device)
        self._tok_hash: torch.Tensor | None = None
        # Grammar masks and logit biases: rows that use them leave the fused path (grammar.py).
        self.grammars = SlotGrammars(max_slots, vocab_size, self.device, GrammarCompiler(
            tokenizer_path, vocab_size, self.eos_token_ids, grammar_cache_bytes),
            grammar_compile_timeout)
        self.biases = SlotBiases(max_slots, self.device)

    # -- per-request state (host side, cheap) ----------------------------------------------------

    def set_slot(self, slot: int, params: SamplingParams, history_ids: Sequence[int] = (),
                 num_prompt_tokens: int | None = None) -> None:
        """A request (re)starts in `slot`: its parameters, and the cached tokens the penalties
        must count (prefix hits, recomputation) that will not pass `observe_inputs`. Tokens at
        positions >= `num_prompt_tokens` are outputs from before a preemption: presence and
        frequency penalties count them as the request's own output (None: all are prompt).
        Refused parameters (ValueError) leave the slot as it was."""
        self._check_slot(slot)
        stops = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
        self._check_ids(stops, "stop_token_ids")
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._gen))
        elif not 0 <= seed < 2**63:
            raise ValueError("seed must be in [0, 2**63)")
        self._check_ids(list(params.logit_bias), "logit_bias token ids")
        self.slots.set(slot, ParamRow.of(params, seed), stops)
        prompt_len = num_prompt_tokens if num_prompt_tokens is not None else NO_PROMPT_END
        self.penalties.set_slot(slot, params, prompt_len)
        self.biases.set_slot(slot, params.logit_bias)
        self.grammars.set_slot(slot, params.grammar, prompt_len)
        self.observe_inputs(slot, history_ids, 0)

    def observe_inputs(self, slot: int, token_ids: Sequence[int], start_pos: int = 0) -> None:
        """Tokens fed to `slot` this step, the first at sequence position `start_pos`. All count
        for the repetition penalty; those past the prompt (recomputed outputs) also count for
        presence/frequency."""
        if self.grammars.active[slot]:
            self.grammars.observe(slot, token_ids, start_pos)
        if not token_ids or not self.penalties.tracks(slot):
            return
        self._check_ids(token_ids, "input token ids")
        self.penalties.observe(slot, token_ids, start_pos)

    def flush(self) -> None:
        """Upload what set_slot / observe_inputs queued; `sample` calls it first."""
        restarted = self.slots.flush()
        if restarted is not None:
            self.penalties.reset(restarted)
        self.penalties.flush()

    # -- the batched draw ------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               host_slots: Sequence[int] | torch.Tensor | None = None) -> SampleOutput:
        """Draw one token per row. logits [B, V], fp32 or the model's bf16/fp16 (rows may be
        strided); slots, positions int64 [B] on the device; positions[i] is the sequence index
        of the token being sampled (the noise counter).
        `host_slots` (the same slots on the host) lets the sampler choose its processors without
        reading `slots` back from the device; without it, CUDA slots cost one sync.
        Rows with a grammar may have their disallowed logits set to -inf in place."""
        batch = logits.shape[0]
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [B, {self.vocab_size}], got {tuple(logits.shape)}")
        hs = self._check_batch(logits, slots, positions, host_slots)
        self.flush()
        if batch == 0:
            return SampleOutput(torch.zeros(0, dtype=torch.int64, device=logits.device))
        plan = self._plan(hs)
        grammar = bool(self.grammars.n_active) and bool(self.grammars.active[hs].any())
        biased = self._biased(hs)
        if plan.fused and not biased:
            # Grammar rows are masked in place in the logits' own dtype (-inf is exact in
            # bf16/fp16): the batch keeps the one-pass draw.
            masked = self.grammars.apply(logits, hs) if grammar else None
            tokens = self._draw_fused(logits, slots, positions, plan)
            self._record(slots, hs, tokens)
            if masked is not None:
                self.grammars.record(masked, tokens)
            return SampleOutput(tokens)
        x = logits.to(torch.float32)
        if (grammar or biased) and x is logits:
            x = x.clone()  # masked in place below: never write into the caller's logits
        p = self.slots.device_params.rows(slots)  # the batch's parameters: a gather a table
        raw_logprobs = x.log_softmax(dim=1) if plan.logprobs else None
        if biased:
            self.biases.apply(x, hs)

        if plan.repetition:
            assert self.penalties.seen is not None
            x = ops.apply_repetition_penalty(x, self.penalties.seen[slots], p.repetition_penalty)
        if plan.presence_frequency:
            assert self.penalties.counts is not None
            x = ops.apply_presence_frequency(x, self.penalties.counts[slots], p.presence_penalty,
                                             p.frequency_penalty)
        if plan.min_tokens:
            active = self.slots.device_out_len[slots] < p.min_tokens
            x = ops.mask_stop_tokens(x, self.slots.device_stop[slots], active)
        grammar_rows = self.grammars.apply(x, hs) if grammar else None

        if plan.all_greedy:
            tokens = x.argmax(dim=1)
        else:
            temp = p.temperature
            greedy = (temp <= 0) | (p.top_k == 1)
            greedy_tokens = x.argmax(dim=1) if plan.any_greedy else None
            x = x / torch.where(temp > 0, temp, 1.0)[:, None]
            top_k = p.top_k.clamp(max=self.vocab_size)
            if plan.top_p:
                x = ops.apply_top_k_top_p(x, top_k if plan.max_k else None, p.top_p)
            elif plan.max_k:
                x = ops.apply_top_k(x, top_k, plan.max_k)
            if plan.min_p:
                x = ops.apply_min_p(x, p.min_p)
            tokens = ops.gumbel_argmax(x, p.seed, positions.to(torch.int64),
                                       self._token_hashes(), use_triton=self.use_triton)
            if greedy_tokens is not None:
                tokens = torch.where(greedy, greedy_tokens, tokens)

        self._record(slots, hs, tokens)
        if grammar_rows is not None:
            self.grammars.record(grammar_rows, tokens)
        out = SampleOutput(tokens)
        if raw_logprobs is not None:
            out.logprobs = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
            if plan.top_logprobs:
                out.top_logprobs, out.top_ids = raw_logprobs.topk(plan.top_logprobs, dim=1)
        return out

    def shardable(self, host_slots: Sequence[int] | np.ndarray) -> bool:
        """Whether a batch of these slots draws in one pass over its logits, each token scored
        from its own logit and id only (greedy and temperature-only rows; no processor, mask,
        bias or logprobs): then `sample_sharded` can draw from each TP rank's vocabulary shard.
        Read from the host mirror, so it is known before the step's forward."""
        return self.shard_plan(host_slots) is not None

    def shard_plan(self, host_slots: Sequence[int] | np.ndarray) -> SamplingPlan | None:
        """The batch's plan when it is `shardable`, else None: handed to `sample_sharded` by a
        caller that asked first, so the plan is built once a step."""
        hs = np.asarray(host_slots, dtype=np.int64)
        return self._shard_plan(hs) if hs.size else None

    def sample_sharded(self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                       host_slots: Sequence[int] | torch.Tensor | None, shard: VocabShard,
                       combine: Combine, plan: SamplingPlan | None = None) -> SampleOutput:
        """`sample` for a `shardable` batch from one TP rank's shard of the logits ([B, >=
        shard.size], padding columns past it ignored): this rank's best (score, id) per row go
        to `combine`, which must return the same winners on every rank (sharded.py).
        The tokens are those `sample` draws from the gathered logits. `plan`: `shard_plan`'s
        answer for these slots in this step, if the caller has it (nothing may change the slots'
        parameters in between)."""
        batch = logits.shape[0]
        if logits.dim() != 2 or logits.shape[1] < shard.size:
            raise ValueError(f"logits must be [B, >= {shard.size}], got {tuple(logits.shape)}")
        hs = self._check_batch(logits, slots, positions, host_slots)
        if batch == 0:
            return SampleOutput(torch.zeros(0, dtype=torch.int64, device=logits.device))
        if plan is None:
            plan = self._shard_plan(hs)
        if plan is None:
            raise ValueError("this batch needs the full vocabulary's logits: use sample()")
        self.flush()
        temps = seeds = None  # greedy: the plain argmax, no seeds to look up
        if not plan.all_greedy:
            params = self.slots.device_params
            temps, seeds = params.draw_temperature[slots], params.seed[slots]
        scores, ids = shard_best(logits, shard, seeds, positions.to(torch.int64), temps,
                                 self._token_hashes(), self.use_triton)
        tokens = combine(scores, ids)
        self._record(slots, hs, tokens)
        return SampleOutput(tokens)

    def _shard_plan(self, hs: np.ndarray) -> SamplingPlan | None:
        """The batch's plan if it is `shardable`, else None."""
        plan = self._plan(hs)
        grammar = bool(self.grammars.n_active) and bool(self.grammars.active[hs].any())
        return plan if plan.fused and not grammar and not self._biased(hs) else None

    def _plan(self, hs: np.ndarray) -> SamplingPlan:
        """The plan of a batch of these slots (host numpy), from the host mirror."""
        slots = self.slots
        return SamplingPlan.make(slots.host_np.rows(hs), slots.host_out_len_np[hs],
                                 self.vocab_size)

    def _draw_fused(self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                    plan: SamplingPlan) -> torch.Tensor:
        """Greedy and temperature-only rows, straight from the logits in their own dtype: the
        upcast is exact and order-preserving, so argmax and the draw match the fp32 path."""
        if plan.all_greedy:
            return ops.greedy_argmax(logits, self.use_triton)
        params = self.slots.device_params
        return ops.gumbel_argmax(logits, params.seed[slots], positions.to(torch.int64),
                                 self._token_hashes(), temps=params.draw_temperature[slots],
                                 use_triton=self.use_triton)

    def _token_hashes(self) -> torch.Tensor | None:
        """The torch draw's per-token hashes, built once; the Triton kernel hashes inline."""
        if self._tok_hash is None and not self.use_triton:
            self._tok_hash = ops.token_hashes(self.vocab_size, self.device)
        return self._tok_hash

    def _record(self, slots: torch.Tensor, host_slots: np.ndarray, tokens: torch.Tensor) -> None:
        """Sampled tokens join the penalty state (slots within a batch are distinct)."""
        self.slots.record(slots, host_slots)
        self.penalties.record(slots, tokens)

    # -- checks ----------------------------------------------------------------------------------

    def _check_batch(self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     host_slots: Sequence[int] | torch.Tensor | None) -> np.ndarray:
        """The batch's slots on the host (numpy), after checking shapes and range."""
        batch = logits.shape[0]
        if not logits.dtype.is_floating_point:
            raise ValueError(f"logits must be floating point, got {logits.dtype}")
        if host_slots is None:
            host_slots = slots.cpu()
        hs = np.asarray(host_slots.numpy() if isinstance(host_slots, torch.Tensor) else host_slots,
                        dtype=np.int64)
        if hs.shape != (batch,) or slots.shape != (batch,) or positions.shape != (batch,):
            raise ValueError("slots, positions (and host_slots) must be [B]")
        if batch and (int(hs.min()) < 0 or int(hs.max()) >= self.max_slots):
            raise ValueError(f"slots must be in [0, {self.max_slots})")
        return hs

    def _biased(self, hs: np.ndarray) -> bool:
        return bool(self.biases.n_active) and bool(self.biases.active[hs].any())

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.max_slots})")

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        # An out-of-range index on the device would kill the CUDA context: refuse it here.
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise ValueError(f"{what} must be in [0, {self.vocab_size})")
