"""Triton kernels for the elementwise parts of a layer: (residual-add +) RMSNorm, rotary
embedding in place, SiLU-and-mul.

In plain torch each of these is 5-15 small kernels; at decode batch sizes a layer is dominated by
them (thousands of tiny launches per step, even inside a CUDA graph). One kernel each instead.
The layers use them for CUDA tensors; the torch code in norm.py / rotary.py / mlp.py stays the
reference and the CPU path (tests call these functions directly under TRITON_INTERPRET=1).
Arithmetic is fp32 inside the kernels, rounded once on store. MINISGL_DISABLE_FUSED_OPS=1 turns
them off (debugging).
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

_HAVE_TRITON = importlib.util.find_spec("triton") is not None


def usable(x: torch.Tensor) -> bool:
    return x.is_cuda and _HAVE_TRITON and os.environ.get("MINISGL_DISABLE_FUSED_OPS") != "1"


def _k() -> ModuleType:
    from . import fused_kernels

    return fused_kernels


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x ([N, D], or [T, H, D] per head, rows may be strided).
    With `residual` ([N, D] contiguous): residual += x in place, and the norm is of the sum."""
    d = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        rows, heads, s0, s1 = x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    else:
        rows, heads, s0, s1 = x.shape[0], 1, x.stride(0), 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    res = residual if residual is not None else out
    _k()._rmsnorm_kernel[(rows,)](x, res, weight, out, s0, s1, res.stride(0), d, heads, d, eps,
                             HAS_RES=residual is not None, BLOCK=_pow2(d),
                             num_warps=4 if d <= 2048 else 8)
    return out


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (rows may be strided, last dim dense).
    cos/sin: [P, D] fp32 caches with equal halves."""
    t, hq, d = q.shape
    hk = k.shape[1]
    if t == 0:
        return
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.is_contiguous()
    _k()._rope_kernel[(t,)](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0),
                       k.stride(1), cos.stride(0), HQ=hq, HK=hk, HALF=d // 2,
                       BLOCK_HQ=_pow2(hq), BLOCK_HK=_pow2(hk),
                       BLOCK_D=_pow2(d // 2), num_warps=4)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> silu(x[:, :I]) * x[:, I:]."""
    n = x.shape[-1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    block = min(1024, _pow2(n))
    _k()._silu_mul_kernel[(x.shape[0], -(-n // block))](x, out, x.stride(0), out.stride(0), n,
                                                          BLOCK=block, num_warps=4)
    return out
