"""Applying a grammar's token bitmask to logits (fp32, or bf16/fp16 on the fused path): -inf where
the bit is 0.

The bitmask is llguidance's int32 `[n, ceil(V/32)]`, bit `t % 32` of word `t // 32` for token t;
row i masks logits row `rows[i]` in place. On CUDA one Triton pass reads each logit and its word
(no `[n, V]` intermediate tensors, no gather/scatter of the rows); elsewhere torch ops do the same.
"""

from __future__ import annotations

import torch

_BLOCK = 2048


def apply_bitmask(x: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor,
                  use_triton: bool | None = None) -> None:
    """x [B, V] float (rows may be strided), rows int64 [n] on x's device, bits int32 [n, W]."""
    n, vocab = rows.shape[0], x.shape[1]
    if n == 0:
        return
    if (use_triton if use_triton is not None else x.is_cuda) and x.stride(1) == 1:
        from ..kernels.grammar import bitmask_kernel

        grid = (n, -(-vocab // _BLOCK))
        bitmask_kernel[grid](x, x.stride(0), rows, bits, bits.stride(0), vocab, BLOCK=_BLOCK)
        return
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :vocab].bool()
    x[rows] = x[rows].masked_fill(~allowed, float("-inf"))
