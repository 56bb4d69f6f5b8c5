"""Mixture-of-experts FFN for Qwen3-MoE: routing, a plain-torch reference and a Triton path.

    out[t] = sum_k w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, k]

Weights use the HF layout: w13 [E, 2*I, H] (gate rows then up rows), w2 [E, H, I].

gpt-oss experts (all optional, default off): biases on both GEMMs (w13_bias [E, 2*I] in the same
gate-then-up order, added before the activation; w2_bias [E, H], added before the routing
weight) and `activation=ClampedSwiGLU(alpha, limit)` in place of silu(gate) * up
(clamped_swiglu.py). Both paths compute them.

The Triton path (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) is three steps:
1. align: group the T*K (token, k) pairs by expert, each group padded to the GEMM's BLOCK_M;
2. one grouped GEMM for gate and up of every expert at once, SiLU-and-mul in its epilogue;
3. one grouped GEMM for down, scaled by the routing weight, into a [T, K, H] buffer that is summed
   over K (no atomic adds into the output, so results are bitwise deterministic).
Nothing reads a device value back on the host, so the op can be captured in a CUDA graph.

fp8 experts (`--quantization fp8`): w13/w2 hold float8 e4m3 rows with one fp32 scale a row
(w13_scale [E, 2*I], w2_scale [E, H]); the GEMM inputs are quantized per row too (the hidden
states per token before step 2, the SiLU-and-mul products per pair before step 3), so both GEMMs
run on fp8 tensor cores and scale their fp32 sums, the formula of the dense fp8 projections
(fp8.py). Upcasting fp8 weights to bf16 inside the kernel instead (weight-only) was
measured and dropped: at decode batches it read the bytes at ~2.2 TB/s on an H200 against
bf16's ~3.8, and prefill batches ran at 0.6x bf16 (tests/gpu/test_moe.py --fp8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..fp8 import FP8, quantize_rows, reference_product
from .clamped_swiglu import ClampedSwiGLU

# Up to this many (token, k) pairs one program does all of the alignment (one launch instead of
# four); beyond, per-program work grows with the pairs and the many-program path wins.
SINGLE_ALIGN_MAX_PAIRS = 256
_ALIGN_BLOCK = 64  # pairs per alignment program / loop step
_ALIGN_BLOCK_B = 64  # tiles labelled per loop step


@dataclass(frozen=True)
class GemmTile:
    block_n: int  # output columns per program (gate_up: columns of gate and of up, each)
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 1  # row tiles run back to back per column tile (weight tile reuse in L2)
    swap_ab: bool = False  # compute w . x^T: weight columns on the MMA's M side (see the kernels)


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # rows per tile = padding unit of each expert's group
    gate_up: GemmTile
    down: GemmTile


def choose_config(num_tokens: int, fp8: bool = False) -> MoeConfig:
    """Tile sizes by batch size, for Qwen3-30B-A3B-like shapes (E=128, top-8) on an H100.

    With E experts and top-K, an expert sees about T*K/E rows: decode batches put 1-2 rows in a
    tile, so BLOCK_M is the tensor-core minimum and tiles are narrow to spread the weight reads
    over many SMs (memory-bound); prefill grows the tiles until the GEMMs are compute-bound. The
    table follows the shape of public tuned tables for this model; `tests/gpu/test_moe.py --sweep`
    re-tunes it. fp8 experts move half the bytes a tile, so some batches take other tiles
    (`--fp8 --sweep` on an H200).
    """
    # fp8 experts move half the bytes a tile: at 129-256 tokens an expert sees ~16 rows, so
    # BLOCK_M 16; past 1,024 tokens wider tiles. Both beat the bf16 tiles on an H200, in the op's
    # CUDA-graph time and offline (docs/benchmarks/log/2026-11-23-08.md).
    if fp8 and 128 < num_tokens <= 256:
        return MoeConfig(16, GemmTile(64, 128, 4, 3), GemmTile(256, 64, 8, 3))
    if fp8 and num_tokens > 1024:
        return MoeConfig(64, GemmTile(128, 64, 8, 4), GemmTile(128, 128, 8, 3))
    # bf16 tiles from an H200 sweep (docs/benchmarks/log/2026-11-26-splits.md): a 256-wide down
    # tile for small batches, gate_up 128x128 at 256 tokens. Up to 32 tokens bf16 gate_up runs
    # transposed (swap_ab: wgmma instead of mma.sync for 16-row tiles), faster at 8-32 tokens and
    # not from 64 on (2026-11-26-moe-pdl.md). fp8 experts would gain as much, but wgmma's narrower
    # fp8 accumulator doubles their error against the fp8 formula, so they keep mma.sync.
    if num_tokens <= 32:
        swapped = not fp8
        return MoeConfig(16, GemmTile(64 if swapped else 32, 128, 4, 4, swap_ab=swapped),
                         GemmTile(256, 64, 8, 4))
    if num_tokens <= 128:
        return MoeConfig(16, GemmTile(128, 128, 8, 2), GemmTile(256, 128, 8, 2))
    if num_tokens <= 256:
        return MoeConfig(32, GemmTile(128, 128, 8, 2), GemmTile(256, 64, 8, 3))
    if num_tokens <= 1024:
        return MoeConfig(64, GemmTile(128, 64, 8, 4), GemmTile(256, 64, 8, 4))
    return MoeConfig(128, GemmTile(128, 64, 8, 4), GemmTile(256, 64, 8, 4))


# ------------------------------------------------------------------------------------------------
# Routing and the reference
# ------------------------------------------------------------------------------------------------


def route(router_logits: torch.Tensor, top_k: int,
          norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Qwen3-MoE routing: softmax in fp32 over all experts, top-k, optional renormalisation.

    Returns (topk_weights [T, K] in the logits' dtype, topk_ids [T, K] int64). CUDA logits take
    one Triton kernel (`moe_ops.route_topk`), others the torch formula below.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k={top_k} must be in [1, {router_logits.shape[1]}]")
    if router_logits.is_cuda:
        from .moe_ops import route_topk

        return route_topk(router_logits, top_k, norm_topk_prob)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids




def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights [E, N, K] -> (fp8 [E, N, K], fp32 scale [E, N]), one scale a row
    (max |row| / 448), one expert at a time so the fp32 copy stays one expert's size."""
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        qe, se = quantize_rows(w[e])
        q[e].copy_(qe)
        scale[e].copy_(se.view(-1))
    return q, scale


def _check_scales(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                  w2_scale: torch.Tensor | None) -> None:
    fp8 = (w13.dtype == FP8, w2.dtype == FP8, w13_scale is not None, w2_scale is not None)
    if not any(fp8):
        return
    if not all(fp8):
        raise TypeError("fp8 experts need w13 and w2 in float8_e4m3fn and both scales")
    assert w13_scale is not None and w2_scale is not None
    for name, scale, w in (("w13_scale", w13_scale, w13), ("w2_scale", w2_scale, w2)):
        if tuple(scale.shape) != tuple(w.shape[:2]) or scale.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 {tuple(w.shape[:2])}, got "
                             f"{scale.dtype} {tuple(scale.shape)}")


def _check_biases(hidden: torch.Tensor, w13: torch.Tensor, w13_bias: torch.Tensor | None,
                  w2_bias: torch.Tensor | None) -> None:
    e, two_i, h = w13.shape
    for name, bias, shape in (("w13_bias", w13_bias, (e, two_i)), ("w2_bias", w2_bias, (e, h))):
        if bias is None:
            continue
        if tuple(bias.shape) != shape or bias.dtype != hidden.dtype:
            raise ValueError(f"{name} must be {hidden.dtype} {shape}, got {bias.dtype} "
                             f"{tuple(bias.shape)}")
        if bias.device != hidden.device:
            raise ValueError(f"{name} is on {bias.device}, hidden on {hidden.device}")


def _check_args(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None, w13_bias: torch.Tensor | None = None,
                w2_bias: torch.Tensor | None = None) -> None:
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("expected hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]")
    t, h = hidden.shape
    e, two_i, h13 = w13.shape
    if h13 != h or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"shape mismatch: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={t}, K]")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be integer, got {topk_ids.dtype}")
    _check_scales(w13, w2, w13_scale, w2_scale)
    _check_biases(hidden, w13, w13_bias, w2_bias)
    if not (hidden.dtype.is_floating_point
            and (w13_scale is not None or hidden.dtype == w13.dtype == w2.dtype)):
        raise TypeError(f"hidden, w13, w2 must share one float dtype, got "
                        f"{hidden.dtype}, {w13.dtype}, {w2.dtype}")
    scales = [t for t in (w13_scale, w2_scale) if t is not None]
    devices = {x.device for x in (hidden, w13, w2, topk_ids, topk_weights, *scales)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    # Reading ids back costs a device sync, so only CPU tensors are range-checked here.
    if topk_ids.device.type == "cpu" and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= e:
            raise ValueError(f"topk_ids must be in [0, {e}), got values in [{lo}, {hi}]")


def moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, *, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None,
                  activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """The exact semantics in plain torch, one expert at a time (the CPU path and the test oracle).

    Expert matmuls run in the input dtype, as HF does; the sum over k accumulates in fp32. fp8
    experts: fp32 products of the row-quantized inputs and weights, the SiLU-and-mul product
    rounded to the input dtype in between (as the kernels store it); biases are added to the
    fp32 products.
    """
    _check_args(hidden, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, w13_bias, w2_bias)
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        b13 = w13_bias[e] if w13_bias is not None else None
        b2 = w2_bias[e] if w2_bias is not None else None
        if w13_scale is not None and w2_scale is not None:
            gate_up = reference_product(hidden[token], w13[e], w13_scale[e])
            gate, up = (gate_up if b13 is None else gate_up + b13.float()).split(inter, -1)
            act = _activate(gate, up, activation).to(hidden.dtype)
            y = reference_product(act, w2[e], w2_scale[e])
            y = y if b2 is None else y + b2.float()
        else:
            gate, up = F.linear(hidden[token], w13[e], b13).split(inter, dim=-1)
            y = F.linear(_activate(gate, up, activation), w2[e], b2)
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None].float())
    return out.to(hidden.dtype)


def _activate(gate: torch.Tensor, up: torch.Tensor,
              activation: ClampedSwiGLU | None) -> torch.Tensor:
    return F.silu(gate) * up if activation is None else activation(gate, up)


# ------------------------------------------------------------------------------------------------
# Triton path
# ------------------------------------------------------------------------------------------------


@dataclass
class Alignment:
    sorted_pairs: torch.Tensor  # [capacity] int32: pair ids grouped by expert, pads = num_pairs
    expert_of_block: torch.Tensor  # [num_tiles_m] int32: the expert of each BLOCK_M-row tile
    num_padded: torch.Tensor  # [1] int32: used length of sorted_pairs (a multiple of BLOCK_M)
    num_tiles_m: int  # worst-case tile count, for sizing launch grids


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                single_max_pairs: int = SINGLE_ALIGN_MAX_PAIRS) -> Alignment:
    """Group the flat (token, k) pairs by expert, each group padded to a multiple of block_m."""
    from . import fused_moe_kernels as kern
    from . import pdl

    ids = topk_ids.reshape(-1).contiguous()
    num_pairs = ids.numel()
    # Worst case: every used expert wastes block_m - 1 pad slots.
    capacity = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_tiles_m = _cdiv(capacity, block_m)
    dev = ids.device
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=dev)
    expert_of_block = torch.empty(num_tiles_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    e_pad = _next_pow2(num_experts)
    launch = pdl.options(ids)
    if num_pairs <= single_max_pairs:
        kern.align_single_kernel[(1,)](
            ids, sorted_pairs, expert_of_block, num_padded, num_pairs, num_experts,
            E_PAD=e_pad, BLOCK_M=block_m, BLOCK=_ALIGN_BLOCK, BLOCK_B=_ALIGN_BLOCK_B, num_warps=4,
            **launch)
    else:
        scratch = torch.zeros(2 * e_pad, dtype=torch.int32, device=dev)  # counts, cursors
        counts, cursor = scratch[:e_pad], scratch[e_pad:]
        grid = (_cdiv(num_pairs, _ALIGN_BLOCK),)
        kern.count_kernel[grid](ids, counts, num_pairs, num_experts, E_PAD=e_pad,
                                BLOCK=_ALIGN_BLOCK, num_warps=4, **launch)
        kern.plan_kernel[(1,)](counts, cursor, sorted_pairs, expert_of_block, num_padded,
                               num_pairs, E_PAD=e_pad, BLOCK_M=block_m, BLOCK_B=_ALIGN_BLOCK_B,
                               num_warps=8, **launch)
        kern.place_kernel[grid](ids, cursor, sorted_pairs, num_pairs, num_experts,
                                BLOCK=_ALIGN_BLOCK, num_warps=4, **launch)
    return Alignment(sorted_pairs, expert_of_block, num_padded, num_tiles_m)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _stages(tile: GemmTile, dtype: torch.dtype) -> int:
    # fp32 tiles take twice the shared memory of bf16 ones; fewer pipeline stages keep them in.
    return min(tile.num_stages, 2) if dtype == torch.float32 else tile.num_stages


def fused_moe_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     config: MoeConfig | None = None,
                     single_align_max_pairs: int = SINGLE_ALIGN_MAX_PAIRS,
                     w13_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None, *,
                     w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                     activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """The Triton path, always (CPU tensors need TRITON_INTERPRET=1 set before the first call)."""
    from . import fused_moe_kernels as kern
    from . import pdl

    _check_args(hidden, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, w13_bias, w2_bias)
    fp8 = w13_scale is not None
    # Unused by the kernels without fp8 weights (biases); any tensor stands in for the pointers.
    s13 = w13_scale.contiguous() if w13_scale is not None else topk_weights
    s2 = w2_scale.contiguous() if w2_scale is not None else topk_weights
    b13 = w13_bias.contiguous() if w13_bias is not None else topk_weights
    b2 = w2_bias.contiguous() if w2_bias is not None else topk_weights
    clamp = activation or ClampedSwiGLU()  # its numbers are read only when `activation` is set
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return hidden.new_zeros(hidden.shape)
    cfg = config or choose_config(num_tokens, fp8=fp8)
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    # fp32 must stay fp32: TF32 would cost ~1e-3 relative error.
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    al = align_pairs(topk_ids, num_experts, cfg.block_m, single_align_max_pairs)

    x, sx = _quantize_rows(hidden) if fp8 else (hidden, topk_weights)
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    t = cfg.gate_up
    grid = (al.num_tiles_m * _cdiv(inter, t.block_n),)
    kern.gate_up_kernel[grid](
        x, sx, w13, s13, act, al.sorted_pairs, al.expert_of_block, al.num_padded,
        num_pairs, hidden_size, inter, al.num_tiles_m,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), act.stride(0),
        b13, b13.stride(0), clamp.alpha, clamp.limit,
        TOPK=top_k, BLOCK_M=cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        GROUP_M=t.group_m, EVEN_K=hidden_size % t.block_k == 0, PRECISION=precision,
        FP8=fp8, SWAP_AB=t.swap_ab, num_warps=t.num_warps, num_stages=_stages(t, hidden.dtype),
        HAS_BIAS=w13_bias is not None, CLAMPED=activation is not None, **pdl.options(x))

    a, sa = _quantize_rows(act) if fp8 else (act, topk_weights)
    per_pair = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    t = cfg.down
    grid = (al.num_tiles_m * _cdiv(hidden_size, t.block_n),)
    kern.down_kernel[grid](
        a, sa, w2, s2, per_pair, weights, al.sorted_pairs, al.expert_of_block, al.num_padded,
        num_pairs, hidden_size, inter, al.num_tiles_m,
        a.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), per_pair.stride(0),
        b2, b2.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        EVEN_K=inter % t.block_k == 0, PRECISION=precision,
        FP8=fp8, SWAP_AB=t.swap_ab, num_warps=t.num_warps, num_stages=_stages(t, hidden.dtype),
        HAS_BIAS=w2_bias is not None, **pdl.options(a))
    from .moe_ops import sum_over_k

    # fp32 accumulation, rounded once (as torch's sum of half types)
    return sum_over_k(per_pair.view(num_tokens, top_k, hidden_size))


# Past this many tokens `choose_config` keeps its last tile config (its buckets end at 1,024).
_WARM_SCAN_TOKENS = 4096


def warm_token_counts(top_k: int, fp8: bool) -> list[int]:
    """One token count for each distinct (tile config, alignment path) the op can launch: the
    Triton variants of a config compile on its first call, which would otherwise come mid-run
    (Qwen3-30B-A3B offline: the 257-1,024-token config first met in the timed run, 3 compiles,
    1.2 s of host stall)."""
    seen: dict[tuple[MoeConfig, bool], int] = {}
    for n in range(1, _WARM_SCAN_TOKENS + 1):
        seen.setdefault((choose_config(n, fp8=fp8), n * top_k <= SINGLE_ALIGN_MAX_PAIRS), n)
    return sorted(seen.values())


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, dtype: torch.dtype,
            w13_scale: torch.Tensor | None = None,
            w2_scale: torch.Tensor | None = None, *, w13_bias: torch.Tensor | None = None,
            w2_bias: torch.Tensor | None = None,
            activation: ClampedSwiGLU | None = None) -> list[int]:
    """Run the Triton path once at each of `warm_token_counts` (CUDA weights only), so every
    kernel variant compiles at start-up (with the experts' own biases and activation: those
    are compile-time switches). Returns the token counts run."""
    if not w13.is_cuda:
        return []
    num_experts, _, hidden_size = w13.shape
    counts = warm_token_counts(top_k, w13_scale is not None)
    for n in counts:
        hidden = torch.zeros(n, hidden_size, dtype=dtype, device=w13.device)
        ids = (torch.arange(n * top_k, device=w13.device) % num_experts).view(n, top_k)
        weights = torch.full((n, top_k), 1.0 / top_k, dtype=dtype, device=w13.device)
        fused_moe_triton(hidden, w13, w2, ids, weights, w13_scale=w13_scale, w2_scale=w2_scale,
                         w13_bias=w13_bias, w2_bias=w2_bias, activation=activation)
    return counts


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 rows, fp32 scale [M]): the Triton kernel on CUDA, the torch formula elsewhere
    (the interpreter's fp32 -> fp8 cast does not round to nearest)."""
    if x.is_cuda:
        from . import fused_ops

        q, scale = fused_ops.quantize_rows_fp8(x)
    else:
        q, scale = quantize_rows(x)
    return q, scale.view(-1)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, *, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None,
              activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """[T, H] MoE output. CUDA tensors take the Triton kernels; CPU tensors the torch reference
    (the interpreter is far too slow to serve from, and the test calls fused_moe_triton itself)."""
    if hidden.is_cuda:
        return fused_moe_triton(hidden, w13, w2, topk_ids, topk_weights,
                                w13_scale=w13_scale, w2_scale=w2_scale, w13_bias=w13_bias,
                                w2_bias=w2_bias, activation=activation)
    return moe_reference(hidden, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale,
                         w13_bias=w13_bias, w2_bias=w2_bias, activation=activation)
