"""kernels/moe_mxfp4_gemv.py (the MXFP4 experts' decode path) under the Triton interpreter
against the dequantized reference, and the dispatch between it and the grouped GEMMs."""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_worker.kernels import (  # noqa: E402
    fused_moe_kernels,
    moe_mxfp4,
    moe_mxfp4_gemv,
    moe_ops,
)
from minisgl_worker.kernels.clamped_swiglu import ClampedSwiGLU  # noqa: E402
from minisgl_worker.kernels.moe_mxfp4 import (  # noqa: E402
    GemvConfig,
    GemvTile,
    mxfp4_moe_gemv,
    mxfp4_moe_reference,
)
from minisgl_worker.quant import mxfp4  # noqa: E402

for _mod, _fn in ((fused_moe_kernels, "align_single_kernel"), (moe_ops, "_sum_over_k_kernel"),
                  (moe_mxfp4_gemv, "mxfp4_gemv_kernel")):
    if type(getattr(_mod, _fn)).__name__ != "InterpretedFunction":
        importlib.reload(_mod)  # imported earlier in this process without the interpreter


def _experts(e: int, h: int, inter: int, gen: torch.Generator):  # noqa: ANN202
    b13, s13 = mxfp4.quantize(torch.randn(e, 2 * inter, h, generator=gen) * 0.2)
    b2, s2 = mxfp4.quantize(torch.randn(e, h, inter, generator=gen) * 0.2)
    # spread the block scales (e8m0 bytes well apart, the lowest ones included) so a wrong
    # scale per block shows
    s13 = (s13.int() + torch.randint(-3, 4, s13.shape, generator=gen)).clamp(0, 128).to(
        torch.uint8)
    s2 = (s2.int() + torch.randint(-3, 4, s2.shape, generator=gen)).clamp(0, 128).to(
        torch.uint8)
    return b13.view(e, 2 * inter, h // 2), s13, b2.view(e, h, inter // 2), s2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_p,block_k", [(1, 64), (2, 64), (2, 128)])
def test_gemv_equals_reference(dtype: torch.dtype, block_p: int, block_k: int) -> None:
    """Biases, the clamped SwiGLU past its limit, H=96 (BLOCK_K 64: a half-masked last K step;
    128: one step, most of it masked), I=64, strips wrapping past N, several experts, pairs
    sharing an expert (tokens routed to the same expert: one program's pairs when grouped) and
    more pairs of one expert than a program takes."""
    gen = torch.Generator().manual_seed(0)
    e, h, inter, t, k = 4, 96, 64, 6, 2
    w13, s13, w2, s2 = _experts(e, h, inter, gen)
    x = torch.randn(t, h, generator=gen).to(dtype)
    ids = torch.tensor([[0, 1], [1, 2], [0, 1], [3, 1], [1, 0], [2, 3]])  # expert 1: 5 pairs
    weights = torch.softmax(torch.randn(t, k, generator=gen), -1).to(dtype)
    act = ClampedSwiGLU(1.702, 0.5)
    b_13 = (0.1 * torch.randn(e, 2 * inter, generator=gen)).to(dtype)
    b_2 = (0.1 * torch.randn(e, h, generator=gen)).to(dtype)
    cfg = GemvConfig(block_p, GemvTile(32, block_k, 4), GemvTile(64, block_k, 2))
    got = mxfp4_moe_gemv(x, w13, w2, ids, weights, s13, s2, w13_bias=b_13, w2_bias=b_2,
                         activation=act, config=cfg)
    want = mxfp4_moe_reference(x, w13, w2, ids, weights, s13, s2, w13_bias=b_13, w2_bias=b_2,
                               activation=act)
    assert want.abs().max() > 0.3
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # plain SiLU-and-mul, no biases: larger values (fp16's reference rounds gate and up first)
    got = mxfp4_moe_gemv(x, w13, w2, ids, weights, s13, s2, config=cfg)
    want = mxfp4_moe_reference(x, w13, w2, ids, weights, s13, s2)
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item() * 4, rtol=tol)


def test_gemv_every_code_and_subnormal_scale() -> None:
    """One expert whose rows hold every FP4 code at every position of a word, with e8m0 scales
    0 (2^-127, the fp32 subnormal range), 1, 127 and 128: the decode is exact, so fp32 results
    equal the reference's up to summation order."""
    h = inter = 64
    codes = (torch.arange(2 * inter * h) * 7 % 16).view(2 * inter, h)
    w13 = mxfp4.pack_codes(codes).view(1, 2 * inter, h // 2)
    w2 = mxfp4.pack_codes(codes[:h, :inter].flip(1)).view(1, h, inter // 2)
    s13 = torch.tensor([0, 1, 127, 128], dtype=torch.uint8).repeat(2 * inter, 1)[:, : h // 32]
    s13[inter:] = torch.tensor([128, 127], dtype=torch.uint8)  # up rows: large scales
    s2 = torch.full((1, h, inter // 32), 120, dtype=torch.uint8)
    x = torch.randn(2, h, generator=torch.Generator().manual_seed(1))
    ids = torch.zeros(2, 1, dtype=torch.long)
    weights = torch.ones(2, 1)
    for block_p in (1, 2):
        cfg = GemvConfig(block_p, GemvTile(16, 32, 1), GemvTile(16, 64, 1))
        got = mxfp4_moe_gemv(x, w13, w2, ids, weights, s13[None], s2, config=cfg)
        want = mxfp4_moe_reference(x, w13, w2, ids, weights, s13[None], s2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dispatch_by_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """mxfp4_moe: CUDA batches up to GEMV_MAX_PAIRS pairs take the GEMVs, larger ones the
    grouped GEMMs; CPU tensors the reference (checked by which function runs)."""
    calls: list[str] = []
    monkeypatch.setattr(moe_mxfp4, "GEMV_MAX_PAIRS", 64)  # the value it takes once measured
    for name in ("mxfp4_moe_gemv", "mxfp4_moe_triton", "mxfp4_moe_reference"):
        monkeypatch.setattr(moe_mxfp4, name, lambda *a, _n=name, **kw: calls.append(_n))

    class _Cuda(torch.Tensor):
        is_cuda = True  # type: ignore[assignment]

    k = 4
    for t in (1, moe_mxfp4.GEMV_MAX_PAIRS // k, moe_mxfp4.GEMV_MAX_PAIRS // k + 1):
        x = torch.zeros(t, 8).as_subclass(_Cuda)
        moe_mxfp4.mxfp4_moe(x, x, x, torch.zeros(t, k, dtype=torch.long), torch.zeros(t, k))
    moe_mxfp4.mxfp4_moe(torch.zeros(1, 8), x, x, torch.zeros(1, k, dtype=torch.long),
                        torch.zeros(1, k))
    assert calls == ["mxfp4_moe_gemv", "mxfp4_moe_gemv", "mxfp4_moe_triton",
                     "mxfp4_moe_reference"]
