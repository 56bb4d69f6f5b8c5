"""One TP rank's share of the work: the model, its KV cache, the attention backend, the sampler,
the CUDA graphs (decode steps whole: cuda_graph.py; prefill and mixed steps in pieces between
the attention calls: piecewise_graph.py), and one step on them.

Per step: the plan becomes a ForwardBatch (host work, two uploads), decode rows take their input
from the slot's token future (`last_tokens`, written by an earlier step's sampler, on the device),
the model runs, logits are computed only for the last token of each sampling request (a decode
CUDA graph computes them for its every row, inside the graph), the sampler
draws, and the tokens are copied to pinned host memory behind an event. At TP > 1 the logits
stay each rank's vocabulary shard when the batch can be drawn from shards
(sampling/sharded.py), and are gathered only otherwise. `run_step` does all of
this without waiting for the device (`Engine.collect` waits for the step's event later: overlap
scheduling).

Every rank runs one ModelRunner: rank 0 inside the `Engine` (engine.py), ranks 1..N-1 in
follower.py. The process group is joined before one is built (distributed/tp_group.py).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch
from minisgl_core.sampling import SamplingParams
from minisgl_core.step import ReqPlan, StepPlan

from .. import distributed as dist
from ..attention import describe
from ..config import EngineConfig
from ..layers.moe import SparseMoeBlock
from ..sampling import SampleOutput
from ..sampling.sharded import exchange_best
from .batch import DeviceStep, PlanBuilder
from .piecewise_graph import PiecewiseGraphs
from .startup import (
    capture_decode_graphs,
    capture_piecewise_graphs,
    check_backend_features,
    check_backend_names,
    choose_backend,
    choose_vocab_shard,
    context_length,
    init_fast_all_reduce,
    load_model_config,
    load_weights,
    make_kv_pool,
    make_sampler,
    shard_heads,
    size_kv_pools,
    window_layout,
)

log = logging.getLogger(__name__)
# One draw on each sampler path, to compile its kernels at start-up (`_warm_up_sampler`).
# Seeded: a slot without a seed would take one from the sampler's generator, moving the seeds
# that later unseeded requests get.
_WARM_UP_DRAWS = (SamplingParams(temperature=0.0, seed=0), SamplingParams(temperature=0.7, seed=0),
                  SamplingParams(temperature=0.7, top_p=0.9, seed=0))


@dataclass
class InFlight:
    """A launched step: its sampled tokens land in the host tensors once `done` fires."""

    step_id: int
    rids: list[int]
    tokens: torch.Tensor | None  # host (pinned on CUDA) int64 [S]
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    want_logprobs: bool
    done: torch.cuda.Event | None
    started: float
    host_ms: float
    graph: str = "eager"  # how the forward ran: cuda_graph, piecewise or eager


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        """`config` and `device` as prepare_rank returns them; with TP, the group joined.
        Start-up is the steps of startup.py, in this order (every rank runs the same
        collectives in it: the all-reduce set-up, the KV sizing and the sampler's seed)."""
        self.config, self.device = config, device
        self.page_size = config.resolved_page_size(device)  # typed int, unlike the config field
        self.dtype = config.torch_dtype(device)
        self.kv_dtype = config.torch_kv_dtype(device)
        check_backend_names(config, device)
        self.model_config = mc = load_model_config(config)
        check_backend_features(config, mc, device)
        self.max_model_len = context_length(config, mc)
        heads, kv_heads = shard_heads(mc)
        self.model = load_weights(config, mc, self.max_model_len, device, self.dtype)
        self.two_shot_max_tokens = init_fast_all_reduce(config, mc, device, self.dtype)
        self.window_layout = layout = window_layout(mc, self.max_model_len)
        self.num_pages, self.window_pages = size_kv_pools(
            config, mc, kv_heads, self.page_size, self.kv_dtype, device, layout,
            self.max_model_len)
        self.pool = make_kv_pool(config, mc, kv_heads, self.num_pages, self.page_size,
                                 self.max_model_len, self.kv_dtype, device, layout,
                                 self.window_pages)
        self.max_pages_per_seq = self.pool.max_pages_per_seq
        self.backend = choose_backend(config, mc, heads, self.pool, self.max_model_len,
                                      self.dtype)
        self.sampler = make_sampler(config, mc, device)
        self.builder = PlanBuilder(config.max_slots, self.max_pages_per_seq, self.num_pages,
                                   self.page_size, self.max_model_len, mc.vocab_size,
                                   device, dummy_page=self.pool.dummy_page,
                                   window_pages=self.window_pages)
        # Each slot's last sampled token, on the device: a decode row's input (token futures).
        self.last_tokens = torch.zeros(config.max_slots, dtype=torch.int64, device=device)
        self.vocab_shard = choose_vocab_shard(config, mc)
        self.graph_runner = capture_decode_graphs(config, self.model, self.backend, self.pool,
                                                  self.vocab_shard)
        self.piecewise: PiecewiseGraphs | None = None
        # On every device, so CPU runs (the TP tests over gloo) take the same path as GPUs.
        self.warm_up_prefill()
        self.piecewise = capture_piecewise_graphs(config, self.model, self.backend, self.pool)
        log.info("KV cache: %d pages x %d tokens (%.2f GiB, %s), backend %s, device %s",
                 self.num_pages, self.page_size, self.pool.memory_bytes() / 2**30,
                 str(self.kv_dtype).removeprefix("torch."),
                 describe(self.backend), self.device)
        if self.window_pages:
            log.info("sliding-window KV pool: %d pages for %d of %d layers (window %d)",
                     self.window_pages, len(layout.layers), mc.num_layers, layout.window)

    # -- start-up: the warm-up (the other steps are in startup.py) -------------------------------

    @torch.inference_mode()
    def warm_up_prefill(self, num_tokens: tuple[int, ...] = (8, 64)) -> float:
        """Throwaway prefills into the first pages before any request, one of each of
        `num_tokens` tokens (8 and 64 take both of the Triton prefill kernel's tile variants,
        whatever the page size): the prefill attention kernels compile (FlashInfer JIT-compiles them on first
        use, slowly for FA3 on a machine without its cache) at start-up, where the startup
        probe waits, instead of inside the first request; so do the sampler's kernels
        (`_warm_up_sampler`) and the MoE experts' kernels at every tile config
        (`fused_moe.warm_up`), and at TP > 1 the two-shot all-reduce of prefill steps past
        the one-shot's sizes. Decode kernels compile in graph capture. Every rank runs it (its
        TP collectives match); the slot it used is left as at start, the pages hold garbage
        that no request reads before writing. Returns the seconds it took."""
        started = time.perf_counter()
        room = min(self.max_model_len, self.num_pages * self.page_size,
                   self.max_pages_per_seq * self.page_size,
                   (self.window_pages or self.num_pages) * self.page_size)
        for n in sorted({max(1, min(n, room)) for n in num_tokens}):
            pages = list(range(-(-n // self.page_size)))
            plan = StepPlan(step_id=-1, reqs=[ReqPlan(
                rid=-1, slot=0, cache_len=0, input_ids=[0] * n, new_pages=pages,
                new_window_pages=pages if self.window_pages else [])])
            hidden, _, _ = self._forward(self._upload(plan), use_graph=False)
        self._warm_up_sampler(hidden)
        fast = dist.tp().fast_all_reduce  # TP: the all-reduce kernels of longer prefills
        if fast is not None:
            fast.warm_up(self.dtype, hidden.shape[-1])
        # MoE tile configs go by the step's token count: compile those this prefill missed.
        moe = next((m for m in self.model.modules() if isinstance(m, SparseMoeBlock)), None)
        if moe is not None and (counts := moe.warm_up_kernels(self.dtype)):
            log.info("MoE kernels warmed up at %s tokens", counts)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        b = self.builder  # slot 0 as it was: no pages, no token future
        b.page_table[0] = 0
        if b.window_table is not None:
            b.window_table[0] = self.window_pages
        b.pages_len[0] = 0
        b.has_future[0] = False
        seconds = time.perf_counter() - started
        log.info("prefill kernels warmed up in %.1fs", seconds)
        return seconds

    def release(self) -> None:
        """Free the device memory this rank holds (CUDA graphs first: NCCL does not tear down a
        communicator that a live graph captured, so they go before the TP group is left)."""
        if self.graph_runner is not None:
            self.graph_runner.release()
        if self.piecewise is not None:
            self.piecewise.release()
        # Drop the big tensors now rather than whenever this object is collected, so an
        # in-process caller can build the next engine in the memory this one held.
        for name in ("graph_runner", "piecewise", "backend", "model", "pool", "sampler", "last_tokens"):
            setattr(self, name, None)
        # The IPC mappings of the other ranks' buffers go now, while those ranks still live
        # (an owner that exits first makes PyTorch warn about tensors still shared).
        dist.use_fast_all_reduce(None)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- one step on this rank --------------------------------------------------------------------

    @torch.inference_mode()
    def run_logits(self, plan: StepPlan) -> torch.Tensor:
        step = self._upload(plan)
        hidden, _, _ = self._forward(step, use_graph=False)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run_step(self, plan: StepPlan) -> InFlight:
        """Build and queue the step's work on this rank (the plan is already validated)."""
        started = time.perf_counter()
        for r in plan.reqs:  # prefill chunks only: decodes carry nothing the sampler keeps
            if r.sampling is not None:
                self.sampler.set_slot(r.slot, r.sampling, r.history_ids,
                                      r.num_prompt_tokens or None)
            self.sampler.observe_inputs(r.slot, r.input_ids, r.cache_len)
        step = self._upload(plan, pad_for_graph=True)
        rids = step.sample_rids
        if not plan.num_entries:
            return InFlight(plan.step_id, [], None, None, None, None, False, None, started, 0.0,
                            graph="")  # nothing ran
        out, is_logits, graph = self._forward(step)
        tokens = logprobs = top_ids = top_lp = None
        want = False
        if rids:
            sampled = self._sample(step, out, is_logits, len(rids) == plan.num_entries)
            self.last_tokens[step.sample_slots] = sampled.token_ids
            want = sampled.logprobs is not None
            tokens, logprobs = self._to_host(sampled.token_ids), self._to_host(sampled.logprobs)
            top_ids, top_lp = self._to_host(sampled.top_ids), self._to_host(sampled.top_logprobs)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        host_ms = (time.perf_counter() - started) * 1e3
        return InFlight(plan.step_id, rids, tokens, logprobs, top_ids, top_lp, want, done,
                         started, host_ms, graph)

    def _sample(self, step: DeviceStep, out: torch.Tensor, is_logits: bool,
                all_rows: bool) -> SampleOutput:
        """Logits of the sampling rows (from `out`, hidden states or a graph's logits) and the
        draw. In the activation dtype: the sampler reads it directly on its fast paths. With a
        vocabulary shard, a batch the sampler can draw per shard never gathers the logits."""
        if not is_logits:
            logits = self._logits(out[step.batch.sample_indices])
        elif all_rows:  # every row samples: the leading rows, no copy
            logits = out[: len(step.sample_rids)]
        else:
            logits = out[step.batch.sample_indices]
        return self._draw(logits, step.sample_slots, step.sample_positions,
                          step.sample_slots_host)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of these rows as the graphs leave them: the activation dtype, and this
        rank's vocabulary shard at TP > 1."""
        if self.vocab_shard is not None:
            return self.model.compute_local_logits(hidden)
        return self.model.compute_logits(hidden, fp32=False)

    def _draw(self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
              host_slots: list[int]) -> SampleOutput:
        shard = self.vocab_shard
        plan = self.sampler.shard_plan(host_slots) if shard is not None else None
        if shard is not None and plan is not None:
            return self.sampler.sample_sharded(logits, slots, positions, host_slots, shard,
                                               exchange_best, plan=plan)
        if shard is not None:  # this rank's shard (graph or eager): the full vocabulary
            logits = self.model.gather_logits(logits)
        return self.sampler.sample(logits, slots, positions, host_slots=host_slots)

    def _warm_up_sampler(self, hidden: torch.Tensor) -> None:
        """Draw once from slot 0 on each of the sampler's kernel paths (greedy, temperature
        only, and the fp32 path that top-p/top-k/min-p, penalties and logprobs take), so that
        their Triton kernels compile at start-up rather than stall the first batch that needs
        one. Every rank draws the same (a sharded draw's exchange is a collective). Slot 0 is
        left with default parameters; a request's first chunk sets its slot's anyway."""
        rows = hidden[-1:]
        slots = torch.zeros(1, dtype=torch.int64, device=self.device)
        host = [0]
        for params in _WARM_UP_DRAWS:
            self.sampler.set_slot(0, params, num_prompt_tokens=0)
            self._draw(self._logits(rows), slots, slots, host)
        self.sampler.set_slot(0, SamplingParams(seed=0))

    def _upload(self, plan: StepPlan, pad_for_graph: bool = False) -> DeviceStep:
        """Host mirrors -> device: the step's metadata, page-table writes, decode inputs. With
        `pad_for_graph` a decode batch comes padded to its CUDA graph's size (logits callers
        want exactly one row per input token, so they do not pad)."""
        runner = self.graph_runner if pad_for_graph else None
        step, _ = self.builder.build(plan, runner.padded_size if runner is not None else None)
        w = step.page_writes
        if w.shape[1]:
            self.pool.page_table[w[0], w[1]] = w[2].int()
        if step.decode_count:
            step.input_ids[step.decode_index] = self.last_tokens[step.decode_slots]
        return step

    def _forward(self, step: DeviceStep,
                 use_graph: bool = True) -> tuple[torch.Tensor, bool, str]:
        """The step's hidden states [T, H], or (second item True) the logits of every row when
        a CUDA graph that computes them ran; third, how it ran (`InFlight.graph`)."""
        batch = step.batch
        runner = self.graph_runner
        if use_graph and runner is not None and runner.can_run(batch):
            out = runner.run(step.input_ids, batch)
            return out, bool(runner.returns_logits), "cuda_graph"
        pieces = self.piecewise
        if use_graph and pieces is not None and pieces.can_run(batch):
            return pieces.run(step.input_ids, batch), False, "piecewise"  # prepares the backend
        self.backend.prepare(batch)
        return self.model(step.input_ids, batch.positions, self.backend), False, "eager"

    def _to_host(self, x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None or self.device.type != "cuda":
            return x
        buf = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        return buf.copy_(x, non_blocking=True)


__all__ = ["InFlight", "ModelRunner"]
