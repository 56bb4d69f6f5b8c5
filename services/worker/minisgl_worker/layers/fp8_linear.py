"""The fp8 projection (`--quantization fp8`): a linear layer whose weight may become fp8 rows
with one fp32 scale each after loading (quantize.py does that), and the product that runs it:
our GEMV for one row, our Triton GEMM (kernels/fp8_gemm.py) for decode-sized batches,
torch._scaled_mm above (MINISGL_FP8_GEMM=scaled_mm: for all), the fp32 reference formula
elsewhere. The format and the formula are in fp8.py.

A pre-quantized checkpoint (prequant.py, loaded by prequant_load.py) fills the same layer with
its own fp8 weights and one of: per-row scales (`weight_scale`, the path above, optionally with a
static activation scale `input_scale`), or 128x128 block scales held per row
(`weight_block_scale` [N, ceil(K/128)], fp8_block.py; kernels/fp8_block_gemm.py on the GPU).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import env
from ..fp8 import Fp8Rows, has_fp8_tensor_cores, quantize_rows, reference_product, silu_mul_rows
from ..fp8_block import GROUP, block_reference, quantize_static, static_reference
from ..kernels import fused_ops


def _scaled_mm_usable(x: torch.Tensor) -> bool:
    """Row-wise scaled fp8 GEMMs: Ada/Hopper and later, bf16 output only."""
    return fused_ops.usable(x) and x.dtype == torch.bfloat16 and has_fp8_tensor_cores(x.device)


def takes_fp8_rows(x: torch.Tensor) -> bool:
    """Whether linear() quantizes these rows on the GPU (so a norm may hand it Fp8Rows)."""
    return x.shape[0] > 0 and not fused_ops.gemv_usable(x) and _scaled_mm_usable(x)


def linear(x: torch.Tensor | Fp8Rows, w: torch.Tensor, w_scale: torch.Tensor,
           bias: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] @ (w * w_scale)[N, K].T (+ bias) -> [M, N] in x's dtype. w: fp8 [N, K],
    w_scale: [N, 1] fp32. With silu_mul x is [M, 2K] [gate | up] rows and the input is
    silu(gate) * up (folded into the activation quantization on the GPU). Fp8Rows (only
    where takes_fp8_rows held for the unquantized rows) skip the quantization."""
    if isinstance(x, Fp8Rows):
        return _fp8_product(x.q, x.scale, w, w_scale, x.dtype, bias)
    if fused_ops.gemv_usable(x):
        return fused_ops.gemv(x, w, bias, silu_mul=silu_mul, w_scale=w_scale.view(-1))
    if x.shape[0] == 0:
        return x.new_empty(0, w.shape[0])
    if _scaled_mm_usable(x):
        qx, sx = fused_ops.quantize_rows_fp8(x, silu_mul=silu_mul)
        return _fp8_product(qx, sx, w, w_scale, x.dtype, bias)
    y = reference_product(silu_mul_rows(x) if silu_mul else x, w, w_scale).to(x.dtype)
    return y + bias if bias is not None else y


def _fp8_product(qx: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """The GPU product of quantized rows: our Triton GEMM for decode-sized batches,
    torch._scaled_mm (cuBLASLt, row-wise scales) above."""
    from ..kernels import fp8_gemm  # imports triton

    config = fp8_gemm.config_for(qx.shape[0])
    if env.SETTINGS.fp8_gemm != "scaled_mm" and fp8_gemm.usable(qx, w, config):
        y = fp8_gemm.fp8_gemm(qx, w, sx, w_scale, dtype, config)
    else:
        y = torch._scaled_mm(qx, w.t(), scale_a=sx, scale_b=w_scale.view(1, -1), out_dtype=dtype)
    return y + bias if bias is not None else y


def block_linear(x: torch.Tensor, w: torch.Tensor, row_scales: torch.Tensor,
                 bias: torch.Tensor | None = None, silu_mul: bool = False,
                 blocks: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T with fp8 w [N, K] and its block scales per row [N, ceil(K/128)].
    On fp8 GPUs: one row goes through the GEMV with the weight scales applied per group (the
    activation unquantized: a weight-read-bound step gains nothing from rounding it); more rows
    are quantized per token and 128-group (one kernel) for cuBLASLt's blockwise GEMM where the
    rows form whole blocks (`blocks`, [N/128, K/128]) and enough rows come, else our Triton
    kernel. Elsewhere the fp32 reference."""
    if fused_ops.gemv_usable(x) and has_fp8_tensor_cores(x.device):
        return fused_ops.gemv(x, w, bias, silu_mul=silu_mul, w_scale=row_scales,
                              scale_group=GROUP)
    if silu_mul:
        x = silu_mul_rows(x)
    if x.is_cuda and has_fp8_tensor_cores(x.device):
        from ..kernels import fp8_block_gemm as kernel  # imports triton

        if (blocks is not None and x.shape[0] >= kernel.CUBLAS_MIN_ROWS
                and kernel.blockwise_available()):
            y = kernel.blockwise_mm(x, w, blocks)
        else:
            qx, sx = kernel.quantize_groups_fp8(x)
            y = kernel.fp8_block_gemm(qx, w, sx, row_scales, x.dtype)
    else:
        y = block_reference(x, w, row_scales).to(x.dtype)
    return y + bias if bias is not None else y


def static_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                  input_scale: torch.Tensor, bias: torch.Tensor | None = None,
                  silu_mul: bool = False) -> torch.Tensor:
    """Per-row weight scales with a checkpoint's static activation scale (one for all rows)."""
    if silu_mul:
        x = silu_mul_rows(x)
    if x.shape[0] > 0 and _scaled_mm_usable(x):
        qx = quantize_static(x, input_scale)
        sx = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
        return _fp8_product(qx, sx, w, w_scale, x.dtype, bias)
    y = static_reference(x, w, w_scale, input_scale).to(x.dtype)
    return y + bias if bias is not None else y


class Fp8Linear(nn.Module):
    """What the parallel linear layers share: a weight that may be quantized after loading."""

    weight: nn.Parameter
    weight_scale: torch.Tensor | None
    weight_block_scale: torch.Tensor | None
    weight_blocks: torch.Tensor | None
    input_scale: torch.Tensor | None

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight_scale", None)  # [N, 1] fp32 once quantized
        # pre-quantized checkpoints only (prequant_load.py): block scales per row
        # [N, ceil(K/128)] fp32, and a static activation scale (a 1-element fp32 tensor)
        self.register_buffer("weight_block_scale", None)
        self.register_buffer("input_scale", None)
        # the block scales themselves [N/128, K/128] where the rows form whole blocks (set at
        # load when fp8 is kept: cuBLASLt's blockwise GEMM takes them)
        self.register_buffer("weight_blocks", None)
        # other pre-quantized formats (W4A16, INT8: quant_load/): a module holding the packed
        # weight and its scales as parameters, computing x @ W.T; `weight` is then removed
        self.packed: nn.Module | None = None

    def quantize_fp8(self) -> None:
        """Replace the loaded weight by its fp8 rows and their scales (frees the original)."""
        q, scale = quantize_rows(self.weight.data)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = scale

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether this layer would quantize x itself: its norm may then do it (Fp8Rows)."""
        return self.weight_scale is not None and takes_fp8_rows(x)

    def matmul(self, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None = None,
               silu_mul: bool = False) -> torch.Tensor:
        if self.packed is not None:
            assert isinstance(x, torch.Tensor), "no norm feeds a packed layer Fp8Rows"
            y = self.packed(silu_mul_rows(x) if silu_mul else x)
            return y + bias if bias is not None else y
        if self.weight_block_scale is not None:
            assert isinstance(x, torch.Tensor), "no norm feeds a block-scaled layer Fp8Rows"
            return block_linear(x, self.weight, self.weight_block_scale, bias, silu_mul,
                                self.weight_blocks)
        if self.weight_scale is not None and self.input_scale is not None:
            assert isinstance(x, torch.Tensor), "no norm feeds a static-scaled layer Fp8Rows"
            return static_linear(x, self.weight, self.weight_scale, self.input_scale, bias,
                                 silu_mul)
        if self.weight_scale is not None:
            return linear(x, self.weight, self.weight_scale, bias, silu_mul)
        assert isinstance(x, torch.Tensor), "Fp8Rows reach fp8 layers only"
        if silu_mul:  # only a one-row CUDA step gets here unquantized (GatedMLP checks)
            return fused_ops.gemv(x, self.weight, bias, silu_mul=True)
        return fused_ops.linear(x, self.weight, bias)
