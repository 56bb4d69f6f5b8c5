"""The formats of pre-quantized FP8 checkpoints (prequant.py) beyond fp8.py's per-row one, and
their reference products (fp32 torch: what CPU runs with kept fp8 weights and what the GPU
kernels are checked against).

Block scales: the checkpoint gives one scale per 128x128 block of W [N, K]. In memory they are
held expanded along the rows, [N, ceil(K/128)] (one row of K-block scales per output row): a
packed projection (q|k|v, whose parts each start a new block row) and a TP rank whose rows start
inside a block then index their scales like any other row, exactly. It costs 4 bytes per 128
weights (3 % of the fp8 bytes).

The product of a block-scaled layer, per row m of x and n of W, over K-groups g of 128:
    y[m, n] = sum_g (sum_{k in g} qx[m, k] * qw[n, k]) * sx[m, g] * sw[n, g]
with qx/sx the activation quantized per token and group (s = max|x_g| / 448), as DeepSeek-V3 and
transformers' finegrained fp8 do. A static activation scale (per tensor) quantizes all rows with
the checkpoint's one scale: q = x / s saturated.
"""

from __future__ import annotations

import torch

from .fp8 import _TINY, FP8, FP8_MAX

GROUP = 128


def groups(k: int) -> int:
    return -(-k // GROUP)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] fp8, s [M, ceil(K/128)] fp32), x[m, g] ~ q[m, g] * s[m, g]; a last
    group shorter than 128 is its own group (zero padding does not move a max)."""
    m, k = x.shape
    kb = groups(k)
    xf = torch.nn.functional.pad(x.float(), (0, kb * GROUP - k)).view(m, kb, GROUP)
    s = xf.abs().amax(-1, keepdim=True).clamp_min(_TINY) / FP8_MAX
    q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, kb * GROUP)[:, :k], s.view(m, kb)


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x quantized with a given per-tensor scale (a checkpoint's input_scale), saturated."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def expand_groups(s: torch.Tensor, k: int) -> torch.Tensor:
    """[R, ceil(K/128)] group scales -> [R, K], each repeated over its group."""
    return s.float().repeat_interleave(GROUP, dim=-1)[..., :k]


def dequantize_blocks(w: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    """fp8 w [N, K] with its expanded block scales [N, ceil(K/128)] -> fp32 [N, K]."""
    return w.float() * expand_groups(row_scales, w.shape[1])


def rows_of_blocks(blocks: torch.Tensor, start: int, n: int, block: int = GROUP) -> torch.Tensor:
    """Rows start..start+n of the per-row view of block scales [ceil(N/128), ...]: row r takes
    block row r // 128. `blocks` holds block rows from start // 128 on."""
    first = start // block
    return blocks.repeat_interleave(block, dim=0)[start - first * block:start - first * block + n]


def block_reference(x: torch.Tensor, w: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    """The block-scaled product in fp32: x [M, K] quantized per token and group here."""
    qx, sx = quantize_groups(x)
    return (qx.float() * expand_groups(sx, x.shape[1])) @ dequantize_blocks(w, row_scales).t()


def static_reference(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     input_scale: torch.Tensor) -> torch.Tensor:
    """Per-row (or per-tensor expanded) weight scales [N, 1], a static activation scale."""
    qx = quantize_static(x, input_scale)
    return (qx.float() @ w.float().t()) * input_scale.float() * w_scale.reshape(1, -1)
