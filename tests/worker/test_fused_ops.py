"""The layers' Triton kernels (norm, rotary, SiLU-and-mul) under the Triton interpreter, against
the torch reference code paths of the same layers."""

from __future__ import annotations

import os

# Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from minisgl_worker.layers import fused_kernels, fused_ops  # noqa: E402
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


def test_layers_use_torch_on_cpu() -> None:
    assert not fused_ops.usable(torch.zeros(1))  # CPU serving never goes through the kernels
