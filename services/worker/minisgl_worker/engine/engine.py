"""The worker engine: runs StepPlans on the model and returns sampled tokens.

The Engine is the `StepExecutor` the gRPC service drives, and TP rank 0: a ModelRunner (runner.py:
the model, KV cache, sampler and one step on them) plus what only rank 0 does. It validates each
plan, broadcasts it to the other ranks, and keeps the launched steps in flight: `launch` queues a
step's work without waiting for the device; `collect` waits for the oldest step's event. So step
N+1 can be launched (and queued on the GPU) before step N's tokens are read: overlap scheduling.

With tensor parallelism the other ranks are a `TPGroup` (distributed/tp_group.py) started before
this rank builds its model; they run follower.py, which builds a ModelRunner, never an Engine.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import torch
from minisgl_core.step import StepExecutor, StepOutput, StepPlan, TopLogprobs, WorkerInfo

from .. import distributed as dist
from ..attention import describe
from ..config import EngineConfig
from ..distributed.tp_group import TPGroup
from .batch import InvalidPlan
from .runner import InFlight, ModelRunner
from .startup import prepare_rank

# What TPGroup spawns for ranks 1..N-1 (`python -m FOLLOWER_MODULE ...`).
FOLLOWER_MODULE = "minisgl_worker.engine.follower"


class Engine(ModelRunner, StepExecutor):
    def __init__(self, config: EngineConfig) -> None:
        if config.tp_rank != 0:
            raise ValueError("the Engine is TP rank 0; ranks > 0 run minisgl_worker.engine.follower")
        config, device = prepare_rank(config)  # checks the config before any spawning
        self._group: TPGroup | None = None
        if config.tp_size > 1:
            self._group = TPGroup.start(config, device, FOLLOWER_MODULE)
        self._inflight: deque[InFlight] = deque()
        self._closed = False
        try:
            super().__init__(config, device)
        except BaseException:
            # A refused checkpoint (or any start-up error) must not leave the TP group behind:
            # the followers stopped, this process's rank state reset for the next engine.
            if self._group is not None:
                self._group.stop()
                self._group = None
            raise

    def info(self) -> WorkerInfo:
        mc = self.model_config
        return WorkerInfo(
            model_name=Path(self.config.model_path).name, num_pages=self.num_pages,
            page_size=self.page_size, max_model_len=self.max_model_len,
            max_slots=self.config.max_slots, vocab_size=mc.vocab_size,
            eos_token_ids=list(mc.eos_token_ids), tp_size=self.config.tp_size,
            device=str(self.device), attention_backend=describe(self.backend),
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            two_shot_max_tokens=self.two_shot_max_tokens, window_pages=self.window_pages,
            window=self.window_layout.window if self.window_pages else 0)

    def launch(self, plan: StepPlan) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")
        self.builder.validate(plan)
        if self.config.tp_size > 1:
            dist.broadcast_object(plan)
        self._inflight.append(self.run_step(plan))

    def collect(self) -> StepOutput:
        if not self._inflight:
            raise RuntimeError("collect() without a launched step")
        f = self._inflight.popleft()
        if f.done is not None:
            f.done.synchronize()
        out = StepOutput(step_id=f.step_id, rids=f.rids, graph=f.graph)
        out.forward_ms = (time.perf_counter() - f.started) * 1e3 if f.done else f.host_ms
        if f.tokens is None:
            return out
        out.token_ids = f.tokens.tolist()
        if f.want_logprobs and f.logprobs is not None:
            out.logprobs = f.logprobs.tolist()
            if f.top_ids is not None and f.top_logprobs is not None:
                out.top_logprobs = [TopLogprobs(i, p) for i, p in
                                    zip(f.top_ids.tolist(), f.top_logprobs.tolist(), strict=True)]
        return out

    def step(self, plan: StepPlan) -> StepOutput:
        """launch + collect (tests, and callers without overlap)."""
        self.launch(plan)
        return self.collect()

    def forward_logits(self, plan: StepPlan) -> torch.Tensor:
        """Run `plan` like a step (KV written, futures read) but return the fp32 logits of every
        input token, [T, vocab], instead of sampling. For tests and scoring; waits for the
        result, so do not interleave it with in-flight steps."""
        if self._inflight:
            raise RuntimeError("forward_logits with steps in flight")
        self.builder.validate(plan)
        if self.config.tp_size > 1:
            dist.broadcast_object(("logits", plan))
        return self.run_logits(plan)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inflight.clear()
        self.release()  # CUDA graphs before the TP group (the followers do the same)
        if self._group is not None:
            self._group.stop()
            self._group = None


__all__ = ["Engine", "EngineConfig", "InvalidPlan"]
