"""MXFP4 (OCP Microscaling, FP4 e2m1 elements, e8m0 block scales): the format gpt-oss ships its
MoE experts in, its reference formulas and its quantization_config.

A weight W [N, K] (N outputs, K inputs: x @ W.T) is cut along K into blocks of 32 elements:

    blocks  uint8 [N, K // 32, 16]   byte j of block g holds element 32g + 2j in its low nibble
                                     and element 32g + 2j + 1 in its high nibble
    scales  uint8 [N, K // 32]       e8m0: the block's scale is 2 ** (s - 127)

    W[n, 32g + i] = FP4[code(n, g, i)] * 2 ** (scales[n, g] - 127)

A code is sign (bit 3), a 2-bit exponent (bits 1-2, bias 1) and one mantissa bit: magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6 (exponent 0 is subnormal: 0 and 0.5). Stacked experts carry a leading
[E] dimension. gpt-oss checkpoints store `mlp.experts.gate_up_proj_blocks` [E, 2I, H/32, 16] (rows
gate and up interleaved, as the bf16 `gate_up_proj` [E, H, 2I] columns are) and `down_proj_blocks`
[E, H, I/32, 16], each with its `_scales`; biases and every other tensor stay bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .config_checks import names, refuse

BLOCK = 32  # elements per scale block
BYTES = BLOCK // 2  # bytes per block
SCALE_BIAS = 127
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of the largest magnitude (6 = 1.5 * 2**2)


def e2m1_values(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 values of the FP4 codes, from the bit fields (not a typed-in table)."""
    code = torch.arange(16)
    exp, man = (code >> 1) & 3, (code & 1).float()
    mag = torch.where(exp == 0, 0.5 * man, (1.0 + 0.5 * man) * torch.exp2(exp.float() - 1.0))
    return torch.where(code >= 8, -mag, mag).to(dtype)


def unpack_codes(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [..., G, 16] -> codes uint8 [..., G * 32] in element order (low nibble first)."""
    lo, hi = blocks & 0x0F, blocks >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*blocks.shape[:-2], -1)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., K] (K a multiple of 32, values 0..15) -> uint8 blocks [..., K // 32, 16]."""
    if codes.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 packs rows of a multiple of {BLOCK} elements, "
                         f"got {codes.shape[-1]}")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, BYTES, 2)
    return c[..., 0] | (c[..., 1] << 4)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., N, G, 16] (or [..., N, G * 16]) and scales [..., N, G] -> W [..., N, G * 32].

    Exact in any float dtype with fp32's exponent range (fp32, bf16): an element is a 2-bit
    significand times a power of two."""
    g = scales.shape[-1]
    blocks = blocks.reshape(*scales.shape, BYTES)
    values = e2m1_values(torch.float32).to(blocks.device)[unpack_codes(blocks).long()]
    pow2 = torch.exp2(scales.float() - SCALE_BIAS)
    w = values.view(*scales.shape, BLOCK) * pow2[..., None]
    return w.reshape(*scales.shape[:-1], g * BLOCK).to(dtype)


def reference_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W.T with W the dequantized [N, K] weight, in x's dtype (the weight-only
    product: activations are never quantized)."""
    return x @ dequantize(blocks, scales, x.dtype).T


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., K] -> (blocks uint8 [..., K // 32, 16], scales uint8 [..., K // 32]), for tests and
    benchmarks: the OCP rule, shared exponent floor(log2(amax)) - 2, each element rounded to the
    nearest e2m1 value (saturating at 6)."""
    k = w.shape[-1]
    if k % BLOCK:
        raise ValueError(f"MXFP4 quantizes rows of a multiple of {BLOCK} elements, got {k}")
    x = w.float().reshape(*w.shape[:-1], k // BLOCK, BLOCK)
    amax = x.abs().amax(-1)
    exp = torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - E2M1_EMAX
    exp = exp.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = x / torch.exp2(exp)[..., None]
    table = e2m1_values(torch.float32).to(w.device)[:8]  # magnitudes, ascending
    # nearest magnitude, a tie to the smaller one: the code is how many midpoints lie below
    code = torch.bucketize(scaled.abs(), (table[1:] + table[:-1]) / 2)
    code = code | ((scaled < 0) & (code > 0)).long() << 3
    blocks = pack_codes(code.reshape(*w.shape[:-1], k))
    return blocks, (exp + SCALE_BIAS).to(torch.uint8)


# ------------------------------------------------------------------------------------------------
# quantization_config
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mxfp4Details:
    """CheckpointQuant.details of an MXFP4 checkpoint."""

    not_converted: tuple[str, ...] = ()  # module patterns stored bf16 (modules_to_not_convert)

    def describe(self) -> str:
        return ("quant_method mxfp4: MoE experts in FP4 e2m1 with e8m0 scales per 32 inputs, "
                "bf16 activations; every other weight bf16")


_KEYS = ("quant_method", "modules_to_not_convert")


def parse_config(qc: dict[str, Any]) -> tuple[tuple[str, ...], Mxfp4Details]:
    """(modules_to_not_convert, details) of an mxfp4 quantization_config; any other key is a
    one-line error naming it. Which layers are MXFP4 is then read from the checkpoint's tensor
    names (a layer listed as not converted stores bf16 tensors and loads as such)."""
    for key, value in qc.items():
        if key not in _KEYS:
            raise refuse(key, value, "an mxfp4 setting this engine does not implement")
    kept = names(qc.get("modules_to_not_convert"), "modules_to_not_convert")
    return kept, Mxfp4Details(kept)
