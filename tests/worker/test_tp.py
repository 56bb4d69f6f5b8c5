"""Tensor parallelism on CPU: two real processes over gloo give TP=1's logits and tokens."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from minisgl_core.sampling import SamplingParams
from minisgl_core.step import ReqPlan, StepPlan
from minisgl_worker.engine import Engine, EngineConfig
from minisgl_worker.sampling import SampleOutput

from .driver import GREEDY, run_requests, with_window_pages
from .test_models import PROMPTS

PAGE = 4


@dataclass
class Draws:
    """Rank 0's sampler calls: from its vocabulary shard, or from the gathered logits."""

    sharded: int = 0
    gathered: int = 0


def _count_draws(engine: Engine) -> Draws:
    draws, sampler = Draws(), engine.sampler
    sample, sample_sharded = sampler.sample, sampler.sample_sharded

    def gathered(*args: Any, **kw: Any) -> SampleOutput:
        draws.gathered += 1
        return sample(*args, **kw)

    def sharded(*args: Any, **kw: Any) -> SampleOutput:
        draws.sharded += 1
        return sample_sharded(*args, **kw)

    sampler.sample, sampler.sample_sharded = gathered, sharded  # type: ignore[method-assign]
    return draws


def _run(path: object, tp: int, quantization: str = "none",
         params: SamplingParams | list[SamplingParams] = GREEDY,
         prompts: list[list[int]] = PROMPTS, starts: list[int] | None = None,
         **config: Any) -> tuple[torch.Tensor, list[list[int]], Draws]:
    engine = Engine(EngineConfig(model_path=str(path), page_size=PAGE, num_pages=64,
                                 max_slots=4, tp_size=tp, quantization=quantization, **config))
    try:
        assert engine.info().tp_size == tp
        logits = engine.forward_logits(with_window_pages(
            engine, StepPlan(0, [ReqPlan(0, 0, 0, PROMPTS[0], 0, [0, 1, 2, 3])])))
        draws = _count_draws(engine)
        tokens = run_requests(engine, prompts, 6, PAGE, first_page=8, params=params,
                              starts=starts)
        return logits, tokens, draws
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "gpt_oss", "deepseek_v2",
                                  "deepseek_v3", "gemma3"])
def test_tp2_equals_tp1(tiny_model, arch: str) -> None:  # noqa: ANN001
    """Greedy batches: at TP=2 every draw is sharded (no logits gathered for it). gpt-oss: its
    o_proj and expert down biases are added once over the ranks; sinks split by head."""
    path = tiny_model(arch)
    logits1, tokens1, draws1 = _run(path, 1)
    logits2, tokens2, draws2 = _run(path, 2)
    torch.testing.assert_close(logits2, logits1, atol=1e-4, rtol=1e-4)
    assert tokens2 == tokens1
    assert draws1.sharded == 0 and draws2.gathered == 0 and draws2.sharded == draws1.gathered


def test_tp2_sharded_draw_equals_the_gathered_one(tiny_model) -> None:  # noqa: ANN001
    """Seeded sampled, greedy and unseeded rows, and a top-k request joining at step 3: the
    steps before it draw per shard, those with it gather the logits. The tokens are those of
    --disable-sharded-sampling (which gathers for every step) bit for bit, and of TP=1."""
    path = tiny_model("qwen3")
    prompts = [*PROMPTS, [9, 8, 7, 6, 5]]
    params = [SamplingParams(temperature=0.8, seed=3), GREEDY, SamplingParams(temperature=1.1),
              SamplingParams(temperature=0.7, top_k=8, seed=5)]
    run = dict(params=params, prompts=prompts, starts=[0, 0, 0, 3], sampler_seed=1)
    _, on, draws_on = _run(path, 2, **run)  # type: ignore[arg-type]
    _, off, draws_off = _run(path, 2, disable_sharded_sampling=True, **run)  # type: ignore[arg-type]
    _, tp1, _ = _run(path, 1, **run)  # type: ignore[arg-type]
    assert on == off == tp1
    assert draws_on.sharded == 3 and draws_on.gathered > 0
    assert draws_off.sharded == 0 and draws_off.gathered == draws_on.sharded + draws_on.gathered


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_tp2_with_fp8_weights(tiny_model, arch: str) -> None:  # noqa: ANN001
    """--quantization fp8 at TP=2: each rank quantizes its own shards (row-parallel layers, o
    and down, and the experts' down rows get per-shard scales; o and down per-shard activation
    scales too), so TP=2 rounds differently from TP=1 but is as close to the unquantized model
    (measured: 0.12-0.13 from it for both; a misapplied scale or shard gives ~1)."""
    path = tiny_model(arch)
    ref, _, _ = _run(path, 1)
    fp8_1, _, _ = _run(path, 1, "fp8")
    fp8_2, tokens, _ = _run(path, 2, "fp8")

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    assert 0 < rel(fp8_2, ref) < max(0.2, 1.5 * rel(fp8_1, ref))
    assert len(tokens) == len(PROMPTS) and all(len(t) == 6 for t in tokens)


def test_close_releases_graphs_before_leaving_the_tp_group(tiny_model, monkeypatch) -> None:  # noqa: ANN001
    """NCCL will not abort a communicator that a live CUDA graph captured (on the H200 pair the
    teardown sat in ncclCommAbort until the process died): the graphs must go first. CPU has no
    graphs, so a recorder stands in for the runner; the follower is a real process that must
    leave with status 0, before this rank leaves the group (it hosts the group's store, whose
    early close made the followers' NCCL heartbeat print stack traces)."""
    from minisgl_worker.distributed import tp_group

    order: list[str] = []
    real_destroy = tp_group.dist.destroy_tp

    def destroy() -> None:
        exited = all(p.poll() is not None for p in procs)
        order.append("left the group" + (" after the followers exited" if exited else ""))
        real_destroy()

    monkeypatch.setattr(tp_group.dist, "destroy_tp", destroy)

    class GraphRecorder:
        def release(self) -> None:
            order.append("graphs released")

    real_stop = tp_group.TPGroup.stop

    def stop(group: tp_group.TPGroup, timeout: float = 30.0) -> None:
        order.append("followers stopped")
        real_stop(group, timeout)

    monkeypatch.setattr(tp_group.TPGroup, "stop", stop)
    engine = Engine(EngineConfig(model_path=str(tiny_model("qwen3")), page_size=PAGE,
                                 num_pages=64, max_slots=4, tp_size=2))
    assert engine._group is not None
    procs = list(engine._group.procs)
    engine.graph_runner = GraphRecorder()
    engine.close()
    assert order == ["graphs released", "followers stopped",
                     "left the group after the followers exited"]
    assert [p.wait(30) for p in procs] == [0]


def test_a_follower_rank_never_loads_the_engine() -> None:
    """The TP ranks 1..N-1 run a ModelRunner; the Engine (rank 0's front) stays out of them."""
    code = ("import sys, minisgl_worker.engine.follower\n"
            "assert 'minisgl_worker.engine.runner' in sys.modules\n"
            "assert 'minisgl_worker.engine.engine' not in sys.modules, 'the engine was loaded'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("mb", [0, -1, 1025])
def test_custom_all_reduce_cap_out_of_range_is_refused(mb: int) -> None:
    with pytest.raises(ValueError, match="custom_all_reduce_max_mb must be in"):
        EngineConfig(model_path="unused", custom_all_reduce_max_mb=mb)


def test_a_negative_two_shot_step_is_refused() -> None:
    with pytest.raises(ValueError, match="two_shot_max_tokens must be >= 0"):
        EngineConfig(model_path="unused", two_shot_max_tokens=-1)
    assert EngineConfig(model_path="unused", two_shot_max_tokens=0).two_shot_step_tokens() == 0
    # default: the scheduler's default prefill chunk and a full decode batch in one step
    assert EngineConfig(model_path="unused", max_slots=64).two_shot_step_tokens() == 8192 + 64
    assert EngineConfig(model_path="unused", max_slots=64,
                        max_prefill_tokens=100).two_shot_step_tokens() == 164
    with pytest.raises(ValueError, match="max_prefill_tokens must be >= 1"):
        EngineConfig(model_path="unused", max_prefill_tokens=0)


def test_lamport_programs_two_an_sm_only_where_two_surely_fit() -> None:
    from minisgl_worker.kernels.all_reduce import _lamport_workers

    assert _lamport_workers(128, 4, 1024) == (256, {})  # 4 warps: any register count fits twice
    assert _lamport_workers(128, 8, 4096) == (256, {"maxnreg": 128})  # 2 x 256 x 128 = 64K
    assert _lamport_workers(128, 8, 8192) == (128, {})  # wider rows need more registers
