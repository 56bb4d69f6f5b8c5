"""The gated feed-forward: down(act(gate(x)) * up(x)), gate and up packed in one matmul; act is
SiLU (SwiGLU) or, for Gemma, GELU with the tanh approximation (GeGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..fp8 import Fp8Rows
from ..kernels import fused_ops
from .linear import ColumnParallelLinear, RowParallelLinear


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if fused_ops.usable(x):
        return fused_ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


ACTIVATIONS = ("silu", "gelu_tanh")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int,
                 activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"MLP activation {activation!r} is not supported ({ACTIVATIONS})")
        self.activation = activation
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def defer_reduction(self) -> None:
        self.down_proj.defer_reduction()

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation == "gelu_tanh":  # no fused kernel: torch's GELU, as transformers
            return self.down_proj(gelu_tanh_and_mul(gate_up))
        if self.down_proj.folds_silu_mul(gate_up):  # batch-1 GEMV or fp8: SiLU-and-mul inside
            return self.down_proj(gate_up, silu_mul=True)
        return self.down_proj(silu_and_mul(gate_up))
