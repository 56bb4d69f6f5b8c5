"""RMSNorm as HF computes it: statistics in fp32, scale applied after casting back. On CUDA one
Triton kernel (fused_ops.rmsnorm) does the work, residual add included."""

from __future__ import annotations

import torch
from torch import nn

from . import fused_ops
from .weights import default_loader, new_param, set_loader


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = set_loader(new_param(dim), default_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Over the last dim of x ([N, D], or [T, H, D] for per-head q/k norms)."""
        if fused_ops.usable(x):
            return fused_ops.rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(x + residual) and the new residual (x + residual)."""
        if fused_ops.usable(x) and residual.is_contiguous() and x.is_contiguous():
            residual = residual.clone() if residual.data_ptr() == x.data_ptr() else residual
            return fused_ops.rmsnorm(x, self.weight, self.eps, residual=residual), residual
        residual = x + residual
        return self.forward(residual), residual
