"""The fp8 weight format and the online quantization (`--quantization fp8`): the projections of every layer
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

Where each piece lives: this module is the format (e4m3 rows, per-row scales, the reference
product; no layer imports), layers/fp8_linear.py the projection that runs it, quantize.py the
walk over a loaded model that turns its layers to fp8 (called by the loader).
Quantization is lossy (3 mantissa bits): logits move by several percent of their range on dummy
weights, so greedy outputs can differ from bf16 where two tokens are close (docs/operations.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_TINY = float(torch.finfo(torch.float32).tiny)  # the scale of an all-zero row


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


def silu_mul_rows(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [gate | up] rows, rounded to x's dtype (as fused_ops stores it)."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


@functools.cache
def has_fp8_tensor_cores(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def check_supported(method: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse at start-up what would run the slow reference formula on a GPU (it upcasts every
    weight to fp32 on each call): fp8 there needs bf16 activations and fp8 tensor cores."""
    if method != "fp8" or device.type != "cuda":
        return
    if dtype != torch.bfloat16:
        raise ValueError(f"--quantization fp8 on a GPU needs --dtype bfloat16, got {dtype}")
    if not has_fp8_tensor_cores(device):
        raise ValueError("--quantization fp8 needs fp8 tensor cores (compute capability 8.9+: "
                         f"Ada, Hopper or newer); {torch.cuda.get_device_name(device)} has "
                         f"{torch.cuda.get_device_capability(device)}")
