"""The TP all-reduce plumbing that needs no second rank to check: which all-reduce a tensor takes,
and the norm that sums a deferred row-parallel output before its residual add. (The one-shot
kernel itself is a GPU check: tests/gpu/test_all_reduce.py; TP=2 against TP=1 end to end:
tests/worker/test_tp.py.)"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from minisgl_worker.distributed import process_group as pg
from minisgl_worker.layers.linear import RowParallelLinear
from minisgl_worker.layers.norm import RMSNorm


@dataclass
class FakeFast:
    """Takes tensors of at most `max_numel` elements; sums as if there were two equal ranks."""

    max_numel: int
    calls: list[int] = field(default_factory=list)

    def supports(self, x: torch.Tensor, with_norm: bool = False) -> bool:
        return x.numel() <= self.max_numel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.numel())
        return x.mul_(2)

    warm_ups: list[tuple[torch.dtype, int]] = field(default_factory=list)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
        raise AssertionError("CPU tensors never take the fused CUDA kernel")

    def warm_up(self, dtype: torch.dtype, hidden_size: int) -> None:
        self.warm_ups.append((dtype, hidden_size))


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pretend to be rank 0 of 2; torch.distributed's all-reduce records its calls and doubles."""
    monkeypatch.setattr(pg, "_TP", pg.TPState(rank=0, size=2))
    nccl_calls: list[int] = []

    def fake_all_reduce(x: torch.Tensor, group: object = None) -> None:
        nccl_calls.append(x.numel())
        x.mul_(2)

    monkeypatch.setattr(pg.dist, "all_reduce", fake_all_reduce)
    return nccl_calls


def test_supported_messages_take_the_fast_all_reduce_others_torch(two_ranks: list[int]) -> None:
    fast = FakeFast(max_numel=8)
    pg.use_fast_all_reduce(fast)
    small, big = torch.ones(8), torch.ones(9)
    assert pg.all_reduce(small) is small and torch.equal(small, torch.full((8,), 2.0))
    assert pg.all_reduce(big) is big and torch.equal(big, torch.full((9,), 2.0))
    assert fast.calls == [8] and two_ranks == [9]
    pg.use_fast_all_reduce(None)
    pg.all_reduce(small)
    assert fast.calls == [8] and two_ranks == [9, 8]


def test_norm_sums_a_deferred_output_before_its_residual_add(two_ranks: list[int]) -> None:
    """reduce=True: the norm of (sum over ranks of x) + residual, the residual updated; the same
    as reducing first and calling the plain add+norm."""
    pg.use_fast_all_reduce(FakeFast(max_numel=1 << 20))
    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-6)
    norm.weight.data = torch.rand(16) + 0.5
    x, res = torch.randn(3, 16), torch.randn(3, 16)
    out, new_res = norm.add_forward(x.clone(), res.clone(), reduce=True)
    want_out, want_res = norm.add_forward(2 * x, res.clone())
    assert torch.equal(new_res, want_res) and torch.equal(out, want_out)
    assert two_ranks == []  # the fast path took it (the fake one, as a CPU tensor would not)


def test_a_deferred_projection_hands_out_partial_sums(two_ranks: list[int]) -> None:
    layer = RowParallelLinear(8, 4)
    layer.weight.data = torch.randn(4, 4)  # this rank's half of the 8 input features
    x = torch.randn(2, 4)
    reduced = layer(x)
    assert two_ranks == [8]
    layer.defer_reduction()
    partial = layer(x)
    assert two_ranks == [8] and torch.allclose(2 * partial, reduced)
    # A bias enters the deferred sum once: rank 0 adds it (this is rank 0), the others do not.
    with_bias = RowParallelLinear(8, 4, bias=True)
    with_bias.weight.data, with_bias.bias.data = layer.weight.data, torch.randn(4)
    with_bias.defer_reduction()
    torch.testing.assert_close(with_bias(x), partial + with_bias.bias.data)
    assert two_ranks == [8] and with_bias.add_bias


def test_start_up_warms_the_fast_all_reduce_up(tiny_model_path, monkeypatch) -> None:
    """The engine's start-up compiles what only long prefill steps reach (the two-shot kernel,
    past the one-shot's sizes), so that a served engine's first long prompt does not: the
    warm-up calls it once, with the model's activation dtype and hidden size. (Here a TP=1
    engine with a stand-in installed; the kernel itself: tests/gpu/test_compiles.py.)"""
    from minisgl_worker.engine import Engine, EngineConfig

    fast = FakeFast(max_numel=0)
    monkeypatch.setattr(pg, "_TP", pg.TPState(fast_all_reduce=fast))
    engine = Engine(EngineConfig(model_path=str(tiny_model_path), num_pages=16, max_slots=2))
    try:
        assert fast.warm_ups == [(engine.dtype, engine.model_config.hidden_size)]
    finally:
        engine.close()
