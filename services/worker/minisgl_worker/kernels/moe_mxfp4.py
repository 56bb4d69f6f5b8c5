"""MoE experts with MXFP4 weights (gpt-oss's checkpoints): the `experts_fn` of a GptOssMoeBlock
whose experts stay packed on the GPU (quant_load/mxfp4.py).

    w13        uint8 [E, 2 * I, H // 2]   gate rows, then up rows (de-interleaved at load)
    w13_scale  uint8 [E, 2 * I, H // 32]  e8m0
    w2         uint8 [E, H, I // 2]
    w2_scale   uint8 [E, H, I // 32]
(quant/mxfp4.py: the element and scale encodings; every row is packed along K as on disk.)

The computation is fused_moe's (align the (token, k) pairs by expert, one grouped GEMM for gate
and up with bias and clamped SwiGLU in its epilogue, one for down scaled by the routing weight,
the sum over k), the kernels (moe_mxfp4_kernels.py) reading 4.25 bits a weight and dequantizing
in registers. Batches of at most GEMV_MAX_PAIRS (token, k) pairs take the decode path instead
(moe_mxfp4_gemv.py: GEMVs on CUDA cores over the same packed bytes, no second copy). Nothing
reads a device value back on the host: CUDA-graph safe. CPU tensors take
the reference (dequantize, then fused_moe.moe_reference) unless `mxfp4_moe_triton` is called
under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant import mxfp4
from .clamped_swiglu import ClampedSwiGLU
from .fused_moe import GemmTile, MoeConfig, align_pairs, moe_reference

SCALE_MAX = 128  # largest e8m0 byte the in-register bf16 upcast takes (2^(s-1) a finite bf16)
_WARM_SCAN_TOKENS = 4096
# Up to this many (token, k) pairs the experts run as GEMVs (moe_mxfp4_gemv.py), past it as the
# grouped tensor-core GEMMs. 0 (off) until the GEMV has run on a GPU: it is checked under the
# interpreter and compiled for sm_90 only; `tests/gpu/test_mxfp4.py --decode --sweep` measures it
# and then sets this (64 expected: T <= 16 at top-4).
GEMV_MAX_PAIRS = 0


@dataclass(frozen=True)
class GemvTile:
    block_n: int  # output rows a program (gate_up: gate and up rows each)
    block_k: int  # K elements a loop step (a multiple of 32)
    num_warps: int = 4


@dataclass(frozen=True)
class GemvConfig:
    block_p: int  # pairs a program: 1 routes each pair alone, 2 groups pairs by expert
    gate_up: GemvTile
    down: GemvTile


def choose_gemv_config(num_pairs: int) -> GemvConfig:
    """First guesses for gpt-oss (H = I = 2880): a pair a program while few pairs share an
    expert, pairs grouped by expert (each expert's bytes decoded once) past that."""
    block_p = 1 if num_pairs <= 8 else 2
    return GemvConfig(block_p, GemvTile(16, 256, 4), GemvTile(16, 256, 4))


def choose_config(num_tokens: int) -> MoeConfig:
    """Tiles by batch size for gpt-oss-20b/120b (E=32/128, top-4, H=I=2880; an expert sees about
    T * 4 / E rows). Up to 128 tokens an expert sees at most ~16 rows: memory-bound, BLOCK_M the
    MMA minimum, the weight rows on the MMA's M side (swap_ab: wgmma with the dequantized tile
    from registers) and 64-row tiles to spread the bytes over all SMs. Past that, tiles grow
    until the GEMMs are compute-bound. First guesses after fused_moe's bf16 table, to be re-tuned
    by `tests/gpu/test_mxfp4.py --sweep` on an H200."""
    if num_tokens <= 32:
        return MoeConfig(16, GemmTile(64, 128, 4, 4, swap_ab=True),
                         GemmTile(64, 128, 4, 4, swap_ab=True))
    if num_tokens <= 128:
        return MoeConfig(16, GemmTile(64, 128, 4, 3, swap_ab=True),
                         GemmTile(64, 128, 4, 3, swap_ab=True))
    if num_tokens <= 256:
        return MoeConfig(32, GemmTile(128, 64, 4, 3), GemmTile(128, 64, 4, 3))
    if num_tokens <= 1024:
        return MoeConfig(64, GemmTile(128, 64, 8, 3), GemmTile(128, 64, 8, 3))
    return MoeConfig(128, GemmTile(128, 64, 8, 3), GemmTile(128, 64, 8, 3))


def _check(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
           w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    t, h = hidden.shape
    e, two_i, h_half = w13.shape
    inter = two_i // 2
    want = {"w13": (e, two_i, h // 2), "w13_scale": (e, two_i, h // mxfp4.BLOCK),
            "w2": (e, h, inter // 2), "w2_scale": (e, h, inter // mxfp4.BLOCK)}
    for name, x in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if x.dtype != torch.uint8 or tuple(x.shape) != want[name]:
            raise ValueError(f"MXFP4 {name} must be uint8 {want[name]}, got {x.dtype} "
                             f"{tuple(x.shape)} (hidden {tuple(hidden.shape)})")
    if h % mxfp4.BLOCK or inter % mxfp4.BLOCK:
        raise ValueError(f"MXFP4 experts need H={h} and I={inter} divisible by {mxfp4.BLOCK}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={t}, K]")


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [E, N, K // 2] and scales [E, N, K // 32] -> [E, N, K] in dtype."""
    return mxfp4.dequantize(w, scale, dtype)


def mxfp4_moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None, *,
                        w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                        activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """The exact semantics: the experts dequantized into hidden's dtype, then fused_moe's
    reference (expert products in that dtype, the sum over k in fp32)."""
    assert w13_scale is not None and w2_scale is not None, "MXFP4 experts need their scales"
    _check(hidden, w13, w2, w13_scale, w2_scale, topk_ids, topk_weights)
    return moe_reference(hidden, dequantize_experts(w13, w13_scale, hidden.dtype),
                         dequantize_experts(w2, w2_scale, hidden.dtype), topk_ids, topk_weights,
                         w13_bias=w13_bias, w2_bias=w2_bias, activation=activation)


def _use_asm(hidden: torch.Tensor) -> bool:
    return (hidden.is_cuda and hidden.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(hidden.device)[0] >= 8)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def mxfp4_moe_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     w13_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None, *,
                     w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                     activation: ClampedSwiGLU | None = None, config: MoeConfig | None = None,
                     asm: bool | None = None) -> torch.Tensor:
    """The Triton path, always (CPU tensors need TRITON_INTERPRET=1 set before the first call;
    the interpreter has no inline PTX, so `asm` defaults to off there)."""
    from . import moe_mxfp4_kernels as kern
    from . import pdl
    from .moe_ops import sum_over_k

    assert w13_scale is not None and w2_scale is not None, "MXFP4 experts need their scales"
    _check(hidden, w13, w2, w13_scale, w2_scale, topk_ids, topk_weights)
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return hidden.new_zeros(hidden.shape)
    use_asm = _use_asm(hidden) if asm is None else asm
    cfg = config or choose_config(num_tokens)
    hidden = hidden.contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    b13 = w13_bias.contiguous() if w13_bias is not None else weights  # unused stand-ins
    b2 = w2_bias.contiguous() if w2_bias is not None else weights
    clamp = activation or ClampedSwiGLU()  # its numbers are read only when `activation` is set
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    al = align_pairs(topk_ids, num_experts, cfg.block_m)

    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    t = cfg.gate_up
    kern.gate_up_kernel[(al.num_tiles_m * _cdiv(inter, t.block_n),)](
        hidden, w13, w13_scale, act, al.sorted_pairs, al.expert_of_block, al.num_padded,
        num_pairs, hidden_size, inter, al.num_tiles_m, hidden.stride(0), w13.stride(0),
        w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), act.stride(0),
        b13, b13.stride(0), clamp.alpha, clamp.limit,
        TOPK=top_k, BLOCK_M=cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        EVEN_K=hidden_size % t.block_k == 0, PRECISION=precision, SWAP_AB=t.swap_ab, ASM=use_asm,
        HAS_BIAS=w13_bias is not None, CLAMPED=activation is not None,
        num_warps=t.num_warps, num_stages=t.num_stages, **pdl.options(hidden))

    per_pair = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    t = cfg.down
    kern.down_kernel[(al.num_tiles_m * _cdiv(hidden_size, t.block_n),)](
        act, w2, w2_scale, per_pair, weights, al.sorted_pairs, al.expert_of_block,
        al.num_padded, num_pairs, hidden_size, inter, al.num_tiles_m, act.stride(0),
        w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), per_pair.stride(0),
        b2, b2.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        GROUP_M=t.group_m, EVEN_K=inter % t.block_k == 0, PRECISION=precision,
        SWAP_AB=t.swap_ab, ASM=use_asm, HAS_BIAS=w2_bias is not None,
        num_warps=t.num_warps, num_stages=t.num_stages, **pdl.options(act))
    # fp32 accumulation over k, rounded once
    return sum_over_k(per_pair.view(num_tokens, top_k, hidden_size))


def mxfp4_moe_gemv(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w13_scale: torch.Tensor | None = None,
                   w2_scale: torch.Tensor | None = None, *,
                   w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                   activation: ClampedSwiGLU | None = None,
                   config: GemvConfig | None = None) -> torch.Tensor:
    """The decode path (moe_mxfp4_gemv.py), always: CPU tensors need TRITON_INTERPRET=1."""
    from . import moe_mxfp4_gemv as kern
    from . import pdl
    from .moe_ops import sum_over_k

    assert w13_scale is not None and w2_scale is not None, "MXFP4 experts need their scales"
    _check(hidden, w13, w2, w13_scale, w2_scale, topk_ids, topk_weights)
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return hidden.new_zeros(hidden.shape)
    cfg = config or choose_gemv_config(num_pairs)
    if cfg.block_p not in (1, 2):
        raise ValueError(f"the MXFP4 GEMVs take 1 or 2 pairs a program, not {cfg.block_p}")
    hidden = hidden.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    b13 = w13_bias.contiguous() if w13_bias is not None else weights  # unused stand-ins
    b2 = w2_bias.contiguous() if w2_bias is not None else weights
    clamp = activation or ClampedSwiGLU()  # its numbers are read only when `activation` is set
    # the packed rows as int32 words (rows are whole 32-blocks: 16 bytes, 4 words, each)
    w13_words, w2_words = _words(w13), _words(w2)
    if cfg.block_p == 1:
        num_tiles, sorted_pairs, expert_of_block, num_padded = num_pairs, ids, ids, ids
    else:
        al = align_pairs(topk_ids, num_experts, cfg.block_p)
        num_tiles, sorted_pairs = al.num_tiles_m, al.sorted_pairs
        expert_of_block, num_padded = al.expert_of_block, al.num_padded
    common = dict(TOPK=top_k, ALIGNED=cfg.block_p > 1, BLOCK_P=cfg.block_p)
    # element 8j + i of a row at [i, j]: what the GEMVs read as x (gate_up writes act so too)
    x = hidden.view(num_tokens, hidden_size // 8, 8).transpose(1, 2).contiguous()

    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    t = cfg.gate_up
    kern.mxfp4_gemv_kernel[(num_tiles, _cdiv(inter, t.block_n))](
        x, w13_words, w13_scale, act, ids, sorted_pairs, expert_of_block, num_padded,
        weights, b13, num_pairs, inter, hidden_size, x.stride(0), w13_words.stride(0),
        w13_words.stride(1), w13_scale.stride(0), w13_scale.stride(1), act.stride(0),
        b13.stride(0), clamp.alpha, clamp.limit, GATE_UP=True, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, EVEN_K=hidden_size % t.block_k == 0, HAS_BIAS=w13_bias is not None,
        CLAMPED=activation is not None, num_warps=t.num_warps, num_stages=1, **common,
        **pdl.options(hidden))

    per_pair = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    t = cfg.down
    kern.mxfp4_gemv_kernel[(num_tiles, _cdiv(hidden_size, t.block_n))](
        act, w2_words, w2_scale, per_pair, ids, sorted_pairs, expert_of_block, num_padded,
        weights, b2, num_pairs, hidden_size, inter, act.stride(0), w2_words.stride(0),
        w2_words.stride(1), w2_scale.stride(0), w2_scale.stride(1), per_pair.stride(0),
        b2.stride(0), clamp.alpha, clamp.limit, GATE_UP=False, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, EVEN_K=inter % t.block_k == 0, HAS_BIAS=w2_bias is not None,
        CLAMPED=False, num_warps=t.num_warps, num_stages=1, **common, **pdl.options(act))
    return sum_over_k(per_pair.view(num_tokens, top_k, hidden_size))


def _words(w: torch.Tensor) -> torch.Tensor:
    """uint8 [E, N, K // 2] (rows contiguous) -> its int32 view [E, N, K // 8]."""
    return w.contiguous().view(torch.int32)


def mxfp4_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, *, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None,
              activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """[T, H] MoE output (an `experts_fn`): CUDA tensors take the kernels (the GEMVs up to
    GEMV_MAX_PAIRS pairs, the grouped GEMMs past it), CPU ones the reference."""
    if not hidden.is_cuda:
        fn = mxfp4_moe_reference
    elif topk_ids.numel() <= GEMV_MAX_PAIRS:
        fn = mxfp4_moe_gemv
    else:
        fn = mxfp4_moe_triton
    return fn(hidden, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, w13_bias=w13_bias,
              w2_bias=w2_bias, activation=activation)


def warm_token_counts() -> list[int]:
    """One token count per tile config `choose_config` can pick (each compiles its variants)."""
    seen: dict[MoeConfig, int] = {}
    for n in range(1, _WARM_SCAN_TOKENS + 1):
        seen.setdefault(choose_config(n), n)
    return sorted(seen.values())


def warm_up(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
            w2_scale: torch.Tensor, top_k: int, dtype: torch.dtype, *,
            w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
            activation: ClampedSwiGLU | None = None) -> list[int]:
    """Compile every kernel variant at start-up (CUDA only; with the experts' own biases and
    activation, compile-time switches): one call per config, on both alignment paths (a count
    past fused_moe's one-program alignment limit too), and one per decode-path (GEMV) config.
    Returns the GEMM path's token counts run."""
    from .fused_moe import SINGLE_ALIGN_MAX_PAIRS

    if not w13.is_cuda:
        return []
    num_experts, _, half_h = w13.shape
    counts = sorted(set(warm_token_counts()) | {SINGLE_ALIGN_MAX_PAIRS // top_k + 1})
    gemv: dict[GemvConfig, int] = {}  # one token count per decode-path config
    for pairs in range(top_k, GEMV_MAX_PAIRS + 1, top_k):
        gemv.setdefault(choose_gemv_config(pairs), pairs // top_k)
    for n in sorted(gemv.values()):
        hidden = torch.zeros(n, 2 * half_h, dtype=dtype, device=w13.device)
        ids = (torch.arange(n * top_k, device=w13.device) % num_experts).view(n, top_k)
        weights = torch.full((n, top_k), 1.0 / top_k, dtype=dtype, device=w13.device)
        mxfp4_moe_gemv(hidden, w13, w2, ids, weights, w13_scale, w2_scale, w13_bias=w13_bias,
                       w2_bias=w2_bias, activation=activation)
    for n in counts:
        hidden = torch.zeros(n, 2 * half_h, dtype=dtype, device=w13.device)
        ids = (torch.arange(n * top_k, device=w13.device) % num_experts).view(n, top_k)
        weights = torch.full((n, top_k), 1.0 / top_k, dtype=dtype, device=w13.device)
        mxfp4_moe_triton(hidden, w13, w2, ids, weights, w13_scale, w2_scale, w13_bias=w13_bias,
                         w2_bias=w2_bias, activation=activation)
    return counts
