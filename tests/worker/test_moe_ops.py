"""The MoE router and sum-over-k kernels under the Triton interpreter (CPU), against torch."""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_worker.kernels import moe_ops  # noqa: E402
from minisgl_worker.kernels.fused_moe import route  # noqa: E402

if type(moe_ops._route_topk_kernel).__name__ != "InterpretedFunction":
    importlib.reload(moe_ops)  # imported earlier in this process without the interpreter


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (128, 8), (60, 4), (3, 3)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_route_topk_matches_torch_routing(num_experts: int, top_k: int, norm: bool,
                                          num_tokens: int) -> None:
    g = torch.Generator().manual_seed(num_experts * 100 + num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=g) * 3
    want_w, want_ids = route(logits, top_k, norm)  # CPU: the torch formula
    got_w, got_ids = moe_ops.route_topk(logits, top_k, norm)
    assert got_ids.dtype == torch.int64 and got_w.dtype == logits.dtype
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    if norm:
        torch.testing.assert_close(got_w.sum(-1), torch.ones(num_tokens))


def test_route_topk_half_logits_strided_and_empty() -> None:
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(9, 64, generator=g).half()
    logits = wide[:, :32]  # a row stride of 64
    want_w, want_ids = route(logits.float(), 4, True)
    got_w, got_ids = moe_ops.route_topk(logits, 4, True)
    assert got_w.dtype == torch.float16
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w.half())
    w, ids = moe_ops.route_topk(torch.empty(0, 8), 2, True)
    assert w.shape == ids.shape == (0, 2)


def test_route_topk_ties_and_nan_stay_in_range() -> None:
    logits = torch.zeros(2, 8)
    logits[1] = float("nan")
    w, ids = moe_ops.route_topk(logits, 3, True)
    assert ids[0].tolist() == [0, 1, 2]  # ties go to the lowest expert ids
    torch.testing.assert_close(w[0], torch.full((3,), 1 / 3))
    assert bool(((ids >= 0) & (ids < 8)).all())  # garbage in, but never an id out of range


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 8, 64), (3, 2, 1500), (1, 1, 7)])
def test_sum_over_k_matches_torch(dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g).to(dtype)
    got = moe_ops.sum_over_k(x)
    assert got.dtype == dtype and got.shape == (shape[0], shape[2])
    torch.testing.assert_close(got, x.float().sum(1).to(dtype), rtol=1e-6, atol=1e-6)
    assert moe_ops.sum_over_k(x[:0]).shape == (0, shape[2])
