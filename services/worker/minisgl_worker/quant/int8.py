"""INT8 W8A8: compressed-tensors `int-quantized` checkpoints (what llm-compressor's W8A8 recipes,
SmoothQuant + GPTQ or plain RTN, write). Foundation layer: the format, its reference product and
the config parser; quant_load/int8.py loads it, kernels/int8_gemm.py runs it on the GPU.

On disk, per quantized projection (W [N, K], N outputs, K inputs):

    weight         int8 [N, K]   symmetric: W ~ weight * weight_scale, values in -128..127
    weight_scale   [N, 1]        strategy channel (one per output row), or [1] strategy tensor;
                                 in the model dtype (bf16) as llm-compressor writes it
    input_scale    [1]           static per-tensor activations only
    *_zero_point   int8          symmetric checkpoints of older compressed-tensors versions
                                 store all-zero zero points; newer ones store none

The product, per row m of x and row n of W:

    y[m, n] = (sum_k qx[m, k] * qw[n, k]) * sx[m] * sw[n]        (an exact int32 dot)

with the activation row quantized at run time: dynamic per token, s = max|x[m]| / 127, or a
static checkpoint scale s for every row; q = round(x / s) (half to even, as torch.round) clamped
to -128..127. Where the activations stay unquantized (CPU, the dequantized path) the weights are
dequantized once: weight * weight_scale, the checkpoint's function without activation rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .config_checks import UNSET, check_args, compressed_group, refuse

QMIN, QMAX = -128, 127
_TINY = float(torch.finfo(torch.float32).tiny)  # the scale of an all-zero row


@dataclass(frozen=True)
class Int8Settings:
    """CheckpointQuant.details of scheme "int8"."""

    weight_strategy: str  # "channel" ([N, 1] scales) | "tensor" ([1] per projection part)
    static: bool  # activations: the checkpoint's input_scale (per tensor) or dynamic per token

    def describe(self) -> str:
        acts = "static per-tensor" if self.static else "dynamic per-token"
        return (f"compressed-tensors int-quantized: int8 weights, {self.weight_strategy} "
                f"scales, {acts} int8 activations")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], s fp32 [M, 1]): dynamic per-token quantization."""
    xf = x.float()
    s = (xf.abs().amax(dim=-1, keepdim=True) / QMAX).clamp_min(_TINY)
    return torch.round(xf / s).clamp(QMIN, QMAX).to(torch.int8), s


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] with a checkpoint's per-tensor scale -> (q int8, s fp32 [M, 1])."""
    s = scale.float().reshape(1, 1)
    q = torch.round(x.float() / s).clamp(QMIN, QMAX).to(torch.int8)
    return q, s.expand(x.shape[0], 1)


def quantize_weight(w: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest w [N, K] -> (int8 [N, K], fp32 scales [N, 1]); per tensor the
    one scale is repeated per row (the in-memory layout). Benchmarks' synthetic weights."""
    wf = w.float()
    amax = wf.abs().amax(dim=-1, keepdim=True) if per_channel else wf.abs().amax().expand(
        w.shape[0], 1)
    s = (amax / QMAX).clamp_min(_TINY)
    return torch.round(wf / s).clamp(QMIN, QMAX).to(torch.int8), s.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] with its row scales [N, 1] -> fp32 [N, K]."""
    return q.float() * scale.float().reshape(-1, 1)


def int_product(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor,
                sw: torch.Tensor) -> torch.Tensor:
    """The fp32 epilogue of the exact integer dot (float64 holds every int32 sum exactly), in
    the kernels' order: acc * sx[m] * sw[n]."""
    acc = (qx.double() @ qw.double().t()).float()
    return acc * sx.float().reshape(-1, 1) * sw.float().reshape(1, -1)


def reference_linear(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor,
                     input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T with the activations quantized here (dynamic per token, or static with
    input_scale), fp32 [M, N]: the CPU kept-int8 path and the oracle of the GPU kernels."""
    qx, sx = quantize_rows(x) if input_scale is None else quantize_static(x, input_scale)
    return int_product(qx, sx, qw, sw)


# QuantizationArgs keys that do not change what a stored tensor means: calibration details, and
# the dtypes scales / zero points were saved in (the loader reads whatever dtype is stored)
_ARGS_INERT = ("observer", "observer_kwargs", "scale_dtype", "zp_dtype")


def _activations(acts: object, field: str) -> bool:
    """Validates a group's input_activations; whether they are static."""
    if not isinstance(acts, dict):
        raise refuse(field, acts, "weight-only int8 (W8A16) is not implemented")
    # compressed-tensors' defaults: dynamic False, strategy tensor (no group size)
    dynamic = acts.get("dynamic", False)
    acts = {**acts, "strategy": acts.get("strategy") or "tensor"}
    if acts.get("symmetric") is False:
        raise refuse(f"{field}.symmetric", False,
                      "asymmetric int8 activations (input_zero_point) are not implemented")
    check_args(acts, field, {
        "num_bits": (8,), "type": ("int",), "symmetric": (True,), "dynamic": (True, False),
        "strategy": ("token",) if dynamic else ("tensor",), "group_size": UNSET,
        "block_structure": UNSET, "actorder": UNSET}, _ARGS_INERT)
    return not dynamic


def compressed_int8(qc: dict[str, Any]) -> Int8Settings:
    """The settings of a compressed-tensors `int-quantized` quantization_config (format checked
    by the caller, prequant.py); any setting not implemented raises, naming it."""
    field, group = compressed_group(qc, "not implemented (only weights and activations)")
    for key, value in group.items():
        if key == "targets" and value != ["Linear"]:
            raise refuse(f"{field}.targets", value, "only ['Linear'] loads")
        if key == "format" and value not in (None, "int-quantized"):
            raise refuse(f"{field}.format", value, "only int-quantized loads in an int8 config")
        if key == "output_activations" and value is not None:
            raise refuse(f"{field}.output_activations", value, "not implemented")
        if key not in ("targets", "format", "output_activations", "weights",
                       "input_activations"):
            raise refuse(f"{field}.{key}", value, "a quantization group setting not implemented")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise refuse(f"{field}.weights", weights, "a group without weights")
    # strategy: compressed-tensors' default without groups; actorder "static" reorders
    # columns while quantizing only: nothing of it is stored
    weights = {**weights, "strategy": weights.get("strategy") or "tensor"}
    check_args(weights, f"{field}.weights", {
        "num_bits": (8,), "type": ("int",), "symmetric": (True,), "dynamic": (False,),
        "strategy": ("channel", "tensor"), "group_size": UNSET, "block_structure": UNSET,
        "actorder": (None, "static")}, _ARGS_INERT)
    static = _activations(group.get("input_activations"), f"{field}.input_activations")
    return Int8Settings(weights["strategy"], static)
