"""The publishers' 4-bit tensor layouts, read into the canonical W4A16 layout (quant/w4a16.py),
one TP rank's part at a time. For a projection W [N, K] (N outputs, K inputs), G inputs a group,
q the 4-bit value, z its zero point, s its scale, W[n, k] = (q - z) * s:

  AWQ (AutoAWQ WQLinear_GEMM)
    qweight  int32 [K, N/8]    packed along N: nibble i (bits 4i..4i+3) of column c holds output
                               8c + AWQ_ORDER[i] (the order its GEMM kernel unpacks in)
    qzeros   int32 [K/G, N/8]  z, packed as qweight
    scales   fp16 [K/G, N]
  GPTQ (AutoGPTQ / GPTQModel)
    qweight  int32 [K/8, N]    packed along K: nibble j of row r holds input 8r + j
    qzeros   int32 [K/G, N/8]  packed along N, nibble j of column c = output 8c + j; v1 stores
                               z - 1 (read back + 1, as its kernels do), gptq_v2 z itself
    scales   fp16 [K/G, N]
    g_idx    int32 [K]         the group of each input feature (act-order: not k // G); the rows
                               of qweight stay in input order
  compressed-tensors pack-quantized
    weight_packed      int32 [N, K/8]    packed along K, nibble j of column c = input 8c + j,
                                         each the signed value + 8 (so 0..15, zero point 8)
    weight_scale       [N, K/G] (channel: [N, 1])
    weight_zero_point  int32 [N/8, K/G]  asymmetric only: packed along N (nibble j of row r =
                                         output 8r + j), signed zero point + 8
    weight_g_idx       int32 [K]         actorder "group" only
    weight_shape       int [2]           (N, K)

A `Part` says which outputs and inputs (and scale groups) a rank reads; the readers return
canonical tensors: qweight int32 [k/8, n], scales and zeros [groups, n] (zeros as numbers),
g_idx int64 [k].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.weights import WeightSource, check_shape, read, src_shape
from ..quant.w4a16 import PACK, pack_rows

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
IN_ORDER = tuple(range(PACK))

# checkpoint suffix -> the canonical tensor it fills, per layout
SUFFIXES: dict[str, dict[str, str]] = {
    "awq": {".qweight": "qweight", ".qzeros": "zeros", ".scales": "scales"},
    "gptq": {".qweight": "qweight", ".qzeros": "zeros", ".scales": "scales", ".g_idx": "g_idx"},
    "ct": {".weight_packed": "qweight", ".weight_scale": "scales",
           ".weight_zero_point": "zeros", ".weight_g_idx": "g_idx", ".weight_shape": "shape"},
}
# which tensors' dimension N is packed 8 to an int32 (a rank's share of N must be whole int32s)
N_PACKED = {"awq": ("qweight", "zeros"), "gptq": ("zeros",), "ct": ("zeros",)}


@dataclass(frozen=True)
class Part:
    """Outputs [n0, n0 + n) of n_full and inputs [k0, k0 + k) of k_full, with scale groups
    [g0, g0 + g) of size `group` (k_full for per-channel)."""

    n_full: int
    k_full: int
    n0: int
    n: int
    k0: int
    k: int
    group: int
    g0: int
    g: int

    @property
    def groups_full(self) -> int:
        return self.k_full // self.group


def nibbles(raw: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [..., C] -> int64 [..., 8C]: nibble i of entry c lands at 8c + order[i]."""
    shifts = torch.arange(0, 4 * PACK, 4, device=raw.device)
    vals = (raw.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF  # [..., C, 8] by nibble
    out = torch.empty_like(vals)
    out[..., list(order)] = vals
    return out.flatten(-2)


def _block(src: WeightSource, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """src[rows, cols] of a 2-d tensor, each (start, length): only those bytes are read."""
    out = src[rows[0]: rows[0] + rows[1], cols[0]: cols[0] + cols[1]]
    return out if isinstance(out, torch.Tensor) else torch.as_tensor(out)


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


def qweight(layout: str, src: WeightSource, p: Part) -> torch.Tensor:
    if layout == "awq":
        check_shape("AWQ qweight", src_shape(src), (p.k_full, p.n_full // PACK))
        raw = _block(src, (p.k0, p.k), (p.n0 // PACK, p.n // PACK))
        return pack_rows(nibbles(raw, AWQ_ORDER))
    if layout == "gptq":
        check_shape("GPTQ qweight", src_shape(src), (p.k_full // PACK, p.n_full))
        return _block(src, (p.k0 // PACK, p.k // PACK), (p.n0, p.n)).to(torch.int32).contiguous()
    check_shape("weight_packed", src_shape(src), (p.n_full, p.k_full // PACK))
    raw = _block(src, (p.n0, p.n), (p.k0 // PACK, p.k // PACK))
    return pack_rows(nibbles(raw, IN_ORDER).t())


def scales(layout: str, src: WeightSource, p: Part) -> torch.Tensor:
    if layout == "ct":
        check_shape("weight_scale", src_shape(src), (p.n_full, p.groups_full))
        return _block(src, (p.n0, p.n), (p.g0, p.g)).t()
    check_shape(f"{layout.upper()} scales", src_shape(src), (p.groups_full, p.n_full))
    return _block(src, (p.g0, p.g), (p.n0, p.n))


def zeros(layout: str, src: WeightSource, p: Part, offset: int) -> torch.Tensor:
    """Zero points as numbers [g, n] (GPTQ v1: + offset 1)."""
    if layout == "ct":
        check_shape("weight_zero_point", src_shape(src), (p.n_full // PACK, p.groups_full))
        raw = _block(src, (p.n0 // PACK, p.n // PACK), (p.g0, p.g))
        return nibbles(raw.t(), IN_ORDER).float()
    check_shape(f"{layout.upper()} qzeros", src_shape(src), (p.groups_full, p.n_full // PACK))
    raw = _block(src, (p.g0, p.g), (p.n0 // PACK, p.n // PACK))
    return nibbles(raw, AWQ_ORDER if layout == "awq" else IN_ORDER).float() + offset


def g_idx(src: WeightSource, p: Part) -> torch.Tensor:
    check_shape("g_idx", src_shape(src), (p.k_full,))
    return read(src, 0, p.k0, p.k).to(torch.int64)


def check_weight_shape(src: WeightSource, p: Part) -> None:
    """compressed-tensors' weight_shape: the unpacked (N, K) must be this part's."""
    got = tuple(int(v) for v in read(src).tolist())
    _need(got == (p.n_full, p.k_full), f"checkpoint weight_shape {got} disagrees with config.json "
          f"({p.n_full}, {p.k_full})")
