"""The W4A16 weight layout: 4-bit weights, 16-bit activations, one scale (and zero point) per group
of input features. AWQ, GPTQ and compressed-tensors pack-quantized checkpoints are all repacked
into this one layout at load, so one kernel path (kernels/w4a16_gemm.py) serves them.

For a projection y = x @ W.T with W [N, K] (N outputs, K inputs) and groups of G inputs:

    qweight  int32 [K // 8, N]   nibble j (bits 4j..4j+3) of qweight[r, n] is q[8r + j, n] in 0..15
                                 (GPTQ's packing: along K, so a column's groups are contiguous)
    scales   [K // G, N]         model dtype
    zeros    None                symmetric: every zero point is 8
             [K // G, N]         model dtype, the zero point as a number (0..15, exact in bf16)
    perm     None                canonical row i is input feature i
             int32 [K]           canonical row i is input feature perm[i] (GPTQ act-order: rows
                                 sorted by group so groups are contiguous): y = x[:, perm] @ Wc.T
    gidx     None                canonical row i belongs to group i // G
             int32 [K]           its group, explicitly: act-order rows of a row-parallel TP rank,
                                 which do not form whole groups (the kernel's slow path)

    W[n, perm[i]] = (q[i, n] - z[g(i), n]) * s[g(i), n]

Why K-packed, N-contiguous: a decode GEMV program walks K for a strip of N columns, reading whole
int32 rows (coalesced along N) and applying one scale row per group; a GEMM tile unpacks
[BLOCK_K, BLOCK_N] in registers the same way. Per-channel quantization is G = K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PACK = 8  # nibbles an int32 holds
SYMMETRIC_ZERO = 8.0
GROUP_SIZES = (32, 64, 128)  # and per-channel (G = K)


@dataclass(frozen=True)
class W4Weight:
    qweight: torch.Tensor  # int32 [K // 8, N]
    scales: torch.Tensor  # [K // G, N] (or [groups, N] with gidx)
    zeros: torch.Tensor | None  # [K // G, N] or None (zero point 8)
    group_size: int
    perm: torch.Tensor | None = None  # int32 [K]
    gidx: torch.Tensor | None = None  # int32 [K]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * PACK

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]



@dataclass(frozen=True)
class W4Experts:
    """MoE experts in the W4A16 layout, stacked: expert e's W4Weight (no act-order) is
    qweight[e], scales[e], zeros[e] (w13: K = hidden, N = 2 * I gate | up; w2: K = I, N = H)."""

    qweight: torch.Tensor  # int32 [E, K // 8, N]
    scales: torch.Tensor  # [E, K // G, N]
    zeros: torch.Tensor | None  # [E, K // G, N] or None (zero point 8)
    group_size: int


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] integers in 0..15 -> int32 [K // 8, N], nibble j of row r = q[8r + j]."""
    k, n = q.shape
    if k % PACK:
        raise ValueError(f"4-bit packing needs K divisible by {PACK}, got {k}")
    q = q.to(torch.int64).view(k // PACK, PACK, n)
    shifts = (torch.arange(PACK, device=q.device) * 4).view(1, PACK, 1)
    packed = (q << shifts).sum(dim=1)  # < 2**32, exact in int64
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K // 8, N] -> int64 [K, N] in 0..15 (the inverse of pack_rows)."""
    r, n = qweight.shape
    shifts = (torch.arange(PACK, device=qweight.device) * 4).view(1, PACK, 1)
    q = (qweight.to(torch.int64).view(r, 1, n) >> shifts) & 0xF
    return q.view(r * PACK, n)


def group_of_rows(w: W4Weight) -> torch.Tensor:
    """The group of each canonical row, int64 [K]."""
    if w.gidx is not None:
        return w.gidx.to(torch.int64)
    return torch.arange(w.in_features, device=w.qweight.device) // w.group_size


def dequantize(w: W4Weight) -> torch.Tensor:
    """The fp32 weight [N, K] in the checkpoint's input-feature order."""
    q = unpack_rows(w.qweight).float()  # [K, N] canonical rows
    g = group_of_rows(w)
    s = w.scales.float()[g]
    z = w.zeros.float()[g] if w.zeros is not None else SYMMETRIC_ZERO
    wc = (q - z) * s  # [K, N]
    if w.perm is not None:
        out = torch.empty_like(wc)
        out[w.perm.to(torch.int64)] = wc
        wc = out
    return wc.t().contiguous()


def reference_linear(x: torch.Tensor, w: W4Weight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T in fp32, cast to x's dtype: what the kernels are checked against."""
    y = x.float() @ dequantize(w).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def act_order_perm(g_idx: torch.Tensor) -> torch.Tensor:
    """GPTQ act-order: the canonical row order (input features sorted by group, stable), int32."""
    return torch.argsort(g_idx.to(torch.int64), stable=True).to(torch.int32)


def quantize(w: torch.Tensor, group_size: int, symmetric: bool = True,
             perm: torch.Tensor | None = None) -> W4Weight:
    """Round-to-nearest 4-bit quantization of w [N, K] (benchmarks' synthetic weights and tests);
    group_size -1 is per channel. With `perm` the canonical rows are w's input features in that
    order, grouped after permuting (what act-order produces)."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    wf = w.float().t()  # [K, N]
    if perm is not None:
        wf = wf[perm.to(torch.int64)]
    grouped = wf.reshape(k // g, g, n)
    if symmetric:
        s = grouped.abs().amax(dim=1).clamp_min(1e-8) / 7.0
        z = torch.full_like(s, SYMMETRIC_ZERO)
    else:
        lo, hi = grouped.amin(dim=1), grouped.amax(dim=1)
        s = ((hi - lo) / 15.0).clamp_min(1e-8)
        z = torch.round(-lo / s).clamp(0, 15)
    q = torch.round(grouped / s[:, None] + z[:, None]).clamp(0, 15).reshape(k, n)
    zeros = None if symmetric else z.to(w.dtype)
    return W4Weight(pack_rows(q), s.to(w.dtype), zeros, g, perm)
