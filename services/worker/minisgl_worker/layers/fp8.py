"""Online fp8 weight quantization (`--quantization fp8`): the projections of every layer
(qkv, o, gate_up, down; MoE experts too, see below) are stored as float8 e4m3 with one fp32
scale per output row, made from the loaded bf16 weights at start-up, the idea vLLM and SGLang
ship under the same flag.

Why: a decode step reads every weight once, and at the offline workload's batches the projections
are the larger half of the step's bytes and FLOPs; one byte per weight halves both (H100 fp8
tensor cores run twice the bf16 rate).

The product, per row m of x and row n of W, is
    y[m, n] = (sum_k qx[m, k] * qw[n, k]) * sx[m] * sw[n]
with qx/sx the activation row quantized on the fly (dynamic, one scale a row: s = max|x| / 448,
q = x / s saturated). On GPUs with fp8 tensor cores (compute capability 8.9+, bf16 activations)
our Triton GEMM computes it for decode-sized batches (kernels/fp8_gemm.py) and torch._scaled_mm
with row-wise scales for larger ones (MINISGL_FP8_GEMM=scaled_mm: for all). A one-row step
(batch-1 decode) keeps its activation in bf16 and reads the fp8 weights in our GEMV kernel
(fused_ops.gemv). Elsewhere (CPU, fp32 models, older GPUs) the same formula runs in fp32 torch:
the reference the GPU path is checked against (bench/gpu_check_fp8.py) and what CPU tests run;
a GPU without fp8 tensor cores or a non-bf16 model is refused at start-up (check_supported).

MoE experts are fp8 too, with the same formula inside the grouped expert GEMMs (kernels/fused_moe.py).
A norm whose only consumer is an fp8 projection (qkv, a dense MLP's gate_up) quantizes its
output itself (fused_ops.rmsnorm_quant_fp8, handing over Fp8Rows). Left in the activation
dtype: embeddings, the LM head, norms and the MoE router.
Quantization is lossy (3 mantissa bits): logits move by several percent of their range on dummy
weights, so greedy outputs can differ from bf16 where two tokens are close (docs/operations.md).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import nn

from ..config import QUANTIZATIONS
from ..kernels import fused_ops

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_TINY = float(torch.finfo(torch.float32).tiny)  # the scale of an all-zero row
# Read once: linear() runs for every projection of every eager step.
_ONLY_SCALED_MM = os.environ.get("MINISGL_FP8_GEMM") == "scaled_mm"


@dataclass(frozen=True)
class Fp8Rows:
    """Activation rows already quantized (by a norm kernel with the quantization fused in,
    fused_ops.rmsnorm_quant_fp8), ready for an fp8 projection: x[m] ~ q[m] * scale[m]."""

    q: torch.Tensor  # [M, K] float8 e4m3
    scale: torch.Tensor  # [M, 1] fp32
    dtype: torch.dtype  # the activation dtype the rows stand for (the product's output dtype)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [N, K] -> (q [N, K] fp8 e4m3, scale [N, 1] fp32), t[n] ~ q[n] * scale[n]."""
    tf = t.float()
    scale = tf.abs().amax(dim=-1, keepdim=True).clamp_min(_TINY) / FP8_MAX
    return (tf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def reference_product(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The fp8 formula in fp32 torch: x [M, K] quantized per row here, times fp8 rows w [N, K]
    with their N scales (any shape): the CPU path and the oracle of the GPU kernels."""
    qx, sx = quantize_rows(x)
    return (qx.float() @ w.float().t()) * sx * w_scale.reshape(1, -1)


def _silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [gate | up] rows, rounded to x's dtype (as fused_ops stores it)."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


@functools.cache
def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def check_supported(method: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse at start-up what would run the slow reference formula on a GPU (it upcasts every
    weight to fp32 on each call): fp8 there needs bf16 activations and fp8 tensor cores."""
    if method != "fp8" or device.type != "cuda":
        return
    if dtype != torch.bfloat16:
        raise ValueError(f"--quantization fp8 on a GPU needs --dtype bfloat16, got {dtype}")
    if not _has_fp8_tensor_cores(device):
        raise ValueError("--quantization fp8 needs fp8 tensor cores (compute capability 8.9+: "
                         f"Ada, Hopper or newer); {torch.cuda.get_device_name(device)} has "
                         f"{torch.cuda.get_device_capability(device)}")


def _scaled_mm_usable(x: torch.Tensor) -> bool:
    """Row-wise scaled fp8 GEMMs: Ada/Hopper and later, bf16 output only."""
    return fused_ops.usable(x) and x.dtype == torch.bfloat16 and _has_fp8_tensor_cores(x.device)


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
    y = reference_product(_silu_mul(x) if silu_mul else x, w, w_scale).to(x.dtype)
    return y + bias if bias is not None else y


def _fp8_product(qx: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """The GPU product of quantized rows: our Triton GEMM for decode-sized batches,
    torch._scaled_mm (cuBLASLt, row-wise scales) above."""
    from ..kernels import fp8_gemm  # imports triton

    config = fp8_gemm.config_for(qx.shape[0])
    if not _ONLY_SCALED_MM and fp8_gemm.usable(qx, w, config):
        y = fp8_gemm.fp8_gemm(qx, w, sx, w_scale, dtype, config)
    else:
        y = torch._scaled_mm(qx, w.t(), scale_a=sx, scale_b=w_scale.view(1, -1), out_dtype=dtype)
    return y + bias if bias is not None else y


class Fp8Linear(nn.Module):
    """What the parallel linear layers share: a weight that may be quantized after loading."""

    weight: nn.Parameter
    weight_scale: torch.Tensor | None

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight_scale", None)  # [N, 1] fp32 once quantized

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
        if self.weight_scale is not None:
            return linear(x, self.weight, self.weight_scale, bias, silu_mul)
        assert isinstance(x, torch.Tensor), "Fp8Rows reach fp8 layers only"
        if silu_mul:  # only a one-row CUDA step gets here unquantized (GatedMLP checks)
            return fused_ops.gemv(x, self.weight, bias, silu_mul=True)
        return fused_ops.linear(x, self.weight, bias)


def quantize_model(model: nn.Module, method: str) -> int:
    """Quantize every dense projection and MoE expert stack of `model` in place; the count of
    modules quantized. The MoE router (a ReplicatedLinear) stays unquantized: its logits pick the
    experts."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    if method == "none":
        return 0
    from .linear import ColumnParallelLinear, RowParallelLinear
    from .moe import SparseMoeBlock

    kinds = ColumnParallelLinear | RowParallelLinear | SparseMoeBlock
    targets = [m for m in model.modules() if isinstance(m, kinds)]
    for m in targets:
        m.quantize_fp8()
    return len(targets)
