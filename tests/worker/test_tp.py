"""Tensor parallelism on CPU: two real processes over gloo give TP=1's logits and tokens."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from minisgl_core.step import ReqPlan, StepPlan
from minisgl_worker.engine import Engine, EngineConfig

from .driver import run_requests
from .test_models import PROMPTS

PAGE = 4


def _run(path: object, tp: int,
         quantization: str = "none") -> tuple[torch.Tensor, list[list[int]]]:
    engine = Engine(EngineConfig(model_path=str(path), page_size=PAGE, num_pages=64,
                                 max_slots=4, tp_size=tp, quantization=quantization))
    try:
        assert engine.info().tp_size == tp
        logits = engine.forward_logits(StepPlan(0, [ReqPlan(0, 0, 0, PROMPTS[0], 0,
                                                            [0, 1, 2, 3])]))
        tokens = run_requests(engine, PROMPTS, 6, PAGE, first_page=8)
        return logits, tokens
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_tp2_equals_tp1(tiny_model, arch: str) -> None:  # noqa: ANN001
    path = tiny_model(arch)
    logits1, tokens1 = _run(path, 1)
    logits2, tokens2 = _run(path, 2)
    torch.testing.assert_close(logits2, logits1, atol=1e-4, rtol=1e-4)
    assert tokens2 == tokens1


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_tp2_with_fp8_weights(tiny_model, arch: str) -> None:  # noqa: ANN001
    """--quantization fp8 at TP=2: each rank quantizes its own shards (row-parallel layers, o
    and down, and the experts' down rows get per-shard scales; o and down per-shard activation
    scales too), so TP=2 rounds differently from TP=1 but is as close to the unquantized model
    (measured: 0.12-0.13 from it for both; a misapplied scale or shard gives ~1)."""
    path = tiny_model(arch)
    ref, _ = _run(path, 1)
    fp8_1, _ = _run(path, 1, "fp8")
    fp8_2, tokens = _run(path, 2, "fp8")

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
