"""RMSNorm as HF computes it: statistics in fp32, scale applied after casting back. On CUDA one
Triton kernel (fused_ops.rmsnorm) does the work, residual add included, and for a norm that feeds
an fp8 projection (--quantization fp8) also that projection's activation quantization."""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import all_reduce, tp
from ..fp8 import Fp8Rows
from ..kernels import fused_ops
from .fp8_linear import Fp8Linear
from .weights import WeightSource, check_shape, default_loader, new_param, read, set_loader, src_shape


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        if unit_offset:
            self.act_dtype = torch.get_default_dtype()  # the model's, as it is being built
            self.weight = set_loader(nn.Parameter(torch.empty(dim, dtype=torch.float32),
                                                  requires_grad=False), self._load_offset)
        else:
            self.weight = set_loader(new_param(dim), default_loader)

    def _load_offset(self, param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
        check_shape("a norm weight", src_shape(src), tuple(param.shape))
        param.data.copy_(1.0 + read(src).to(self.act_dtype).float())

    def forward(self, x: torch.Tensor, to_fp8: bool = False) -> torch.Tensor | Fp8Rows:
        """Over the last dim of x ([N, D], or [T, H, D] for per-head q/k norms). to_fp8: the
        consumer's fp8 projection takes the rows quantized (Fp8FeedingRMSNorm passes it)."""
        if to_fp8 and fused_ops.usable(x) and x.dim() == 2 and x.is_contiguous():
            return Fp8Rows(*fused_ops.rmsnorm_quant_fp8(x, self.weight, self.eps), x.dtype)
        if fused_ops.usable(x):
            return fused_ops.rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # scaled in fp32, rounded once (the fp32 weight holds 1 + w)
            return (xf * self.weight).to(dtype)
        return self.weight * xf.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor, to_fp8: bool = False,
                    reduce: bool = False) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """norm(x + residual) and the new residual (x + residual); to_fp8 as in forward.
        reduce: x is this TP rank's partial sums (a deferred row-parallel output): summed over
        the ranks first, in the same kernel as the add and the norm where the TP group's custom
        all-reduce takes x (fp8-feeding norms excepted)."""
        if reduce:
            fast = tp().fast_all_reduce
            if (fast is not None and not to_fp8 and x.dim() == 2 and fused_ops.usable(x)
                    and x.is_contiguous() and residual.is_contiguous()
                    and fast.supports(x, with_norm=True) and residual.data_ptr() != x.data_ptr()):
                return fast.add_rmsnorm(x, residual, self.weight, self.eps), residual
            x = all_reduce(x)
        if fused_ops.usable(x) and residual.is_contiguous() and x.is_contiguous():
            residual = residual.clone() if residual.data_ptr() == x.data_ptr() else residual
            if to_fp8 and x.dim() == 2:
                q, scale = fused_ops.rmsnorm_quant_fp8(x, self.weight, self.eps, residual)
                return Fp8Rows(q, scale, x.dtype), residual
            return fused_ops.rmsnorm(x, self.weight, self.eps, residual=residual), residual
        residual = x + residual
        return RMSNorm.forward(self, residual, to_fp8), residual


class Fp8FeedingRMSNorm(RMSNorm):
    """A norm whose only consumer is an fp8 projection: where that projection would quantize the
    rows itself (Fp8Linear.takes_fp8_rows), the norm kernel quantizes them and hands over Fp8Rows.
    quantize.py swaps it in for the plain norm it wraps (same weight) when it quantizes."""

    def __init__(self, norm: RMSNorm, consumer: Fp8Linear) -> None:
        super().__init__(norm.weight.shape[0], norm.eps)
        self.unit_offset = norm.unit_offset
        self.weight = norm.weight
        self.consumer = [consumer]  # a list: the projection belongs to its own module

    def forward(self, x: torch.Tensor, to_fp8: bool = False) -> torch.Tensor | Fp8Rows:
        return super().forward(x, to_fp8 or self.consumer[0].takes_fp8_rows(x))

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor, to_fp8: bool = False,
                    reduce: bool = False) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        return super().add_forward(x, residual, to_fp8 or self.consumer[0].takes_fp8_rows(x),
                                   reduce)
