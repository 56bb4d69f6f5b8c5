"""The layers' Triton kernels (norm, rotary, SiLU-and-mul) under the Triton interpreter, against
the torch reference code paths of the same layers."""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_worker.kernels import fused_kernels, fused_ops  # noqa: E402
from minisgl_worker.layers.mlp import silu_and_mul  # noqa: E402
from minisgl_worker.layers.norm import RMSNorm  # noqa: E402
from minisgl_worker.layers.rotary import RotaryEmbedding  # noqa: E402

if type(fused_kernels._rmsnorm_kernel).__name__ != "InterpretedFunction":
    importlib.reload(fused_kernels)  # imported earlier in this process without the interpreter

GEN = torch.Generator().manual_seed(0)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def _norm(d: int) -> RMSNorm:
    norm = RMSNorm(d, 1e-6)
    norm.weight.data.copy_(1 + 0.1 * _randn(d))
    return norm


@pytest.mark.parametrize("rows, d", [(1, 64), (7, 100), (3, 256)])
def test_rmsnorm_and_residual(rows: int, d: int) -> None:
    norm = _norm(d)
    x, res = _randn(rows, d), _randn(rows, d)
    torch.testing.assert_close(fused_ops.rmsnorm(x, norm.weight, 1e-6), norm(x))
    want_out, want_res = norm.add_forward(x, res.clone())
    res_k = res.clone()
    out = fused_ops.rmsnorm(x, norm.weight, 1e-6, residual=res_k)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(res_k, want_res)


def test_per_head_norm_on_strided_rows() -> None:
    norm = _norm(16)
    qkv = _randn(5, 8 * 16)
    q = qkv[:, :64].view(5, 4, 16)  # a strided view, as after the QKV split
    torch.testing.assert_close(fused_ops.rmsnorm(q, norm.weight, 1e-6), norm(q))


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 16}])
def test_rotary_in_place_on_strided_views(scaling: dict | None) -> None:
    rope = RotaryEmbedding(32, 64, 10000.0, scaling)
    qkv = _randn(6, (4 + 2 + 2) * 32)
    q, k = qkv[:, :128].view(6, 4, 32), qkv[:, 128:192].view(6, 2, 32)
    pos = torch.tensor([0, 5, 9, 17, 40, 63])
    want_q, want_k = rope(pos, q.clone(), k.clone())
    v_before = qkv[:, 192:].clone()
    fused_ops.rotary_(q, k, pos, rope.cos, rope.sin)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    assert torch.equal(qkv[:, 192:], v_before)  # v untouched


@pytest.mark.parametrize("rows, inter", [(1, 64), (4, 1500)])
def test_silu_and_mul(rows: int, inter: int) -> None:
    x = _randn(rows, 2 * inter)
    torch.testing.assert_close(fused_ops.silu_and_mul(x), silu_and_mul(x))


@pytest.mark.parametrize("start", [0, 7, 20])  # a first, a middle and a last (short) block
def test_embedding_shard_rows_and_zeros(start: int) -> None:
    """A rank's block of vocabulary rows start..start+7: its ids' rows, exact, and zeros for
    ids below or past the block (another rank's), as the torch masking gives."""
    w = _randn(7, 48)  # d = 48: masked columns
    ids = torch.tensor([0, 6, 7, 13, 20, 26, 27, 3, 22], dtype=torch.int64)
    local = ids - start
    inside = (local >= 0) & (local < 7)
    want = torch.where(inside[:, None], w[local.clamp(0, 6)], torch.zeros(()))
    got = fused_ops.embedding_shard(ids, w, start)
    assert torch.equal(got, want)
    assert fused_ops.embedding_shard(ids[:0], w, start).shape == (0, 48)


@pytest.mark.parametrize("n, k, config", [
    (40, 256, None),            # the default launch shape: one K step
    (37, 100, None),            # ragged rows and K (masks)
    (19, 300, (4, 64, 4, 2)),   # several K steps, a partial last one
])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(n: int, k: int, config: tuple[int, int, int, int] | None,
                             bias: bool) -> None:
    """The first K slice is peeled off the loop (read before the PDL wait on a GPU)."""
    x, w = _randn(1, k), _randn(n, k)
    b = _randn(n) if bias else None
    got = fused_ops.gemv(x, w, b, config=config)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_folds_silu_and_mul(dtype: torch.dtype) -> None:
    """The down projection's input computed in the kernel, rounded as silu_and_mul stores it."""
    inter, n = 96, 24
    gate_up, w = _randn(1, 2 * inter).to(dtype), (0.1 * _randn(n, inter)).to(dtype)
    want = torch.nn.functional.linear(silu_and_mul(gate_up).float(), w.float())
    got = fused_ops.gemv(gate_up, w, silu_mul=True, config=(8, 32, 4, 2))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)


def test_pdl_only_on_cuda() -> None:
    """CPU tensors (the interpreter) get neither the launch attribute nor the wait
    instructions: griddepcontrol exists on Hopper GPUs only."""
    from minisgl_worker.kernels import pdl

    assert pdl.options(torch.zeros(1)) == {"USE_PDL": False}


def test_gemv_on_strided_weight_rows() -> None:
    w = _randn(12, 80)[:, :64]  # a column slice: rows 80 apart
    x = _randn(1, 64)
    torch.testing.assert_close(fused_ops.gemv(x, w), x @ w.T, rtol=1e-5, atol=1e-4)


def test_mlp_and_lm_head_route_one_row_through_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch-1 plumbing (what a CUDA device gets): linear layers and the LM head call the
    kernel for one row, the MLP folds SiLU-and-mul into down_proj; same result as torch."""
    from minisgl_worker.layers.embedding import ParallelLMHead
    from minisgl_worker.layers.mlp import GatedMLP

    calls: list[bool] = []
    real = fused_ops.gemv

    def spy(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
            silu_mul: bool = False, config: tuple[int, int, int, int] | None = None
            ) -> torch.Tensor:
        calls.append(silu_mul)
        return real(x, w, bias, silu_mul, config)

    mlp, head = GatedMLP(64, 96), ParallelLMHead(50, 64)
    for p in [*mlp.parameters(), *head.parameters()]:
        p.data.copy_(0.1 * _randn(*p.shape))
    x = _randn(1, 64)
    want_mlp, want_logits = mlp(x), head(x)
    monkeypatch.setattr(fused_ops, "gemv", spy)
    monkeypatch.setattr(fused_ops, "gemv_usable", lambda t: t.shape[0] == 1)
    torch.testing.assert_close(mlp(x), want_mlp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head(x), want_logits, rtol=1e-5, atol=1e-5)
    assert calls == [False, True, False]  # gate_up, down (SiLU folded in), LM head
    mlp(_randn(2, 64))  # two rows: cuBLAS
    assert len(calls) == 3


def test_layers_use_torch_on_cpu() -> None:
    assert not fused_ops.usable(torch.zeros(1))  # CPU serving never goes through the kernels


@pytest.mark.parametrize(("n", "k", "config"), [
    (9, 600, (2, 256, 4, 2)),  # a short last group, rows past N masked
    (16, 1024, (8, 1024, 4, 2)),  # the GPU's config: 8 groups a step
    (4, 384, (4, 128, 4, 2)),  # one group a step
])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_gemv_with_group_scales(n: int, k: int, config: tuple[int, int, int, int],
                                silu_mul: bool) -> None:
    """Block-quantized fp8 checkpoints' one-row product: each 128-wide K group of a weight row
    has its own scale (fp8_block.py); against the dequantized weight."""
    from minisgl_worker.fp8_block import dequantize_blocks

    x = _randn(1, 2 * k if silu_mul else k)
    w = (_randn(n, k) * 40).to(torch.float8_e4m3fn)
    s = torch.rand(n, -(-k // 128)) + 0.5
    got = fused_ops.gemv(x, w, silu_mul=silu_mul, w_scale=s, scale_group=128, config=config)
    act = torch.nn.functional.silu(x[:, :k]) * x[:, k:] if silu_mul else x
    want = act @ dequantize_blocks(w, s).t()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
