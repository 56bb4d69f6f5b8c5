"""RMSNorm as HF computes it: statistics in fp32, scale applied after casting back."""

from __future__ import annotations

import torch
from torch import nn

from .weights import default_loader, new_param, set_loader


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = set_loader(new_param(dim), default_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(x + residual) and the new residual (one call, so a fused kernel can replace it)."""
        residual = x + residual
        return self.forward(residual), residual
