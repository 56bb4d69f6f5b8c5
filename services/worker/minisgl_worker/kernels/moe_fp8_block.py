"""Block-scaled fp8 MoE experts (pre-quantized Qwen3-MoE-FP8 / DeepSeek-V3 checkpoints): the
experts function SparseMoeBlock calls (`BLOCK_FP8_EXPERTS`), its Triton path and tile table.

Layout and formula: quant/fp8_experts.py (w13 [E, 2I, H] / w2 [E, H, I] fp8 with block scales
[E, 2*ceil(I/128), ceil(H/128)] / [E, ceil(H/128), ceil(I/128)]). The Triton path
(moe_fp8_block_kernels.py) runs as fused_moe's does, with per-group activation scales:
1. the hidden states quantized per token and 128-wide group (fp8 + [T, ceil(H/128)] scales);
2. align the (token, k) pairs by expert (fused_moe.align_pairs);
3. gate|up grouped GEMM, both scales applied per 128-wide K step, SiLU-and-mul epilogue;
4. the products quantized per pair and group, then the down grouped GEMM times the routing
   weight into [T, K, H], summed over K (moe_ops.sum_over_k: deterministic, no atomics).
No step reads a device value on the host: the op is captured in CUDA graphs like fused_moe.
CPU tensors take the fp32 reference (the interpreter is far too slow to serve from; tests call
`fused_moe_fp8_block` themselves under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import Any

import torch

from ..fp8 import FP8
from ..fp8_block import GROUP, groups, quantize_groups
from ..quant.fp8_experts import check_block_scales, moe_block_reference
from .fused_moe import SINGLE_ALIGN_MAX_PAIRS, GemmTile, MoeConfig, align_pairs

_QUANT_GROUPS = 4  # 128-wide groups one quantization program takes


def choose_config(num_tokens: int) -> MoeConfig:
    """Tiles by batch size for Qwen3-30B-A3B-like experts (E=128, H=2048, I=768, top-8; also
    DeepSeek-V2-Lite's E=64, I=1408, top-6). BLOCK_K must divide 128 (one group a step).

    Decode batches put 1-2 rows of a pair in each expert's tile: BLOCK_M is the MMA minimum and
    the tiles narrow, so the weight reads spread over every SM (memory-bound: ~38 MB of fp8
    experts a step at T=1); prefill batches take wide tiles (compute-bound). A first table after
    the per-row fp8 experts' (fused_moe.choose_config) at half the bytes of bf16 tiles;
    `tests/gpu/test_moe_fp8_block.py --sweep` re-tunes it on an H200.
    """
    if num_tokens <= 32:
        return MoeConfig(16, GemmTile(32, 128, 4, 4), GemmTile(64, 128, 4, 4))
    if num_tokens <= 128:
        return MoeConfig(16, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3))
    if num_tokens <= 256:
        return MoeConfig(16, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 8, 3))
    if num_tokens <= 1024:
        return MoeConfig(64, GemmTile(128, 128, 8, 3), GemmTile(128, 128, 8, 3))
    return MoeConfig(64, GemmTile(128, 128, 8, 4), GemmTile(128, 128, 8, 4))


def quantize_token_groups(x: torch.Tensor,
                          qdtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K], s [M, ceil(K/128)] fp32), fp8_block.quantize_groups's arithmetic:
    one Triton kernel on CUDA (CUDA tensors, or under the interpreter with qdtype float32: its
    fp32 -> fp8 cast does not round to nearest), the torch formula on CPU."""
    if not x.is_cuda and qdtype == FP8:
        return quantize_groups(x)
    from . import moe_fp8_block_kernels as kern
    from . import pdl

    m, k = x.shape
    kg = groups(k)
    q = torch.empty(m, k, dtype=qdtype, device=x.device)
    s = torch.empty(m, kg, dtype=torch.float32, device=x.device)
    if m:
        assert x.stride(-1) == 1
        grid = (m, -(-kg // _QUANT_GROUPS))
        kern.quant_groups_kernel[grid](x, q, s, k, kg, x.stride(0), q.stride(0), s.stride(0),
                                       GROUP=GROUP, GROUPS=_QUANT_GROUPS, num_warps=4,
                                       **pdl.options(x))
    return q, s


def _check_tile(tile: GemmTile) -> None:
    if GROUP % tile.block_k:
        raise ValueError(f"block-scaled experts need BLOCK_K dividing {GROUP}, got {tile}")


def fused_moe_fp8_block(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                        config: MoeConfig | None = None,
                        single_align_max_pairs: int = SINGLE_ALIGN_MAX_PAIRS) -> torch.Tensor:
    """[T, H] in hidden's dtype: the Triton path, always (CPU tensors need TRITON_INTERPRET=1)."""
    from . import moe_fp8_block_kernels as kern
    from . import pdl
    from .moe_ops import sum_over_k

    check_block_scales(w13, w2, w13_scale, w2_scale)
    if w13.dtype != FP8 or w2.dtype != FP8:
        raise TypeError(f"block-scaled experts are fp8 e4m3, got {w13.dtype}, {w2.dtype}")
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return hidden.new_zeros(hidden.shape)
    cfg = config or choose_config(num_tokens)
    _check_tile(cfg.gate_up)
    _check_tile(cfg.down)
    w13, w2 = w13.contiguous(), w2.contiguous()
    s13, s2 = w13_scale.contiguous(), w2_scale.contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    x, sx = quantize_token_groups(hidden.contiguous())
    al = align_pairs(topk_ids, num_experts, cfg.block_m, single_align_max_pairs)

    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    t = cfg.gate_up
    kern.gate_up_kernel[(al.num_tiles_m * -(-inter // t.block_n),)](
        x, sx, w13, s13, act, al.sorted_pairs, al.expert_of_block, al.num_padded,
        num_pairs, hidden_size, inter, al.num_tiles_m, groups(inter),
        x.stride(0), sx.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        act.stride(0), TOPK=top_k, BLOCK_M=cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        GROUP_M=t.group_m, EVEN_K=hidden_size % t.block_k == 0, SWAP_AB=t.swap_ab,
        num_warps=t.num_warps, num_stages=t.num_stages, **pdl.options(x))

    a, sa = quantize_token_groups(act)
    per_pair = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    t = cfg.down
    kern.down_kernel[(al.num_tiles_m * -(-hidden_size // t.block_n),)](
        a, sa, w2, s2, per_pair, weights, al.sorted_pairs, al.expert_of_block, al.num_padded,
        num_pairs, hidden_size, inter, al.num_tiles_m,
        a.stride(0), sa.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        per_pair.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        GROUP_M=t.group_m, EVEN_K=inter % t.block_k == 0, SWAP_AB=t.swap_ab,
        num_warps=t.num_warps, num_stages=t.num_stages, **pdl.options(a))
    # fp32 accumulation, rounded once (as torch's sum of half types)
    return sum_over_k(per_pair.view(num_tokens, top_k, hidden_size))


# Past this many tokens choose_config keeps its last tile config.
_WARM_SCAN_TOKENS = 4096


def warm_token_counts(top_k: int) -> list[int]:
    """One token count per distinct (tile config, alignment path) the op can launch."""
    seen: dict[tuple[MoeConfig, bool], int] = {}
    for n in range(1, _WARM_SCAN_TOKENS + 1):
        seen.setdefault((choose_config(n), n * top_k <= SINGLE_ALIGN_MAX_PAIRS), n)
    return sorted(seen.values())


class BlockFp8Experts:
    """SparseMoeBlock's experts function for block-scaled fp8 experts (layers/moe.py ExpertsFn):
    Triton on CUDA, the fp32 reference elsewhere; `warm_up` compiles every tile config."""

    def __call__(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                 **unsupported: Any) -> torch.Tensor:
        if w13_scale is None or w2_scale is None or any(v is not None
                                                        for v in unsupported.values()):
            raise TypeError("block-scaled fp8 experts take both block scales and no biases "
                            f"or activation ({sorted(unsupported)})")
        if hidden.is_cuda:
            return fused_moe_fp8_block(hidden, w13, w2, topk_ids, topk_weights, w13_scale,
                                       w2_scale)
        return moe_block_reference(hidden, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale)

    def warm_up(self, w13: torch.Tensor, w2: torch.Tensor, top_k: int, dtype: torch.dtype, *,
                w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None) -> list[int]:
        """Run the Triton path once at each of warm_token_counts (CUDA only): the token counts."""
        if not w13.is_cuda or w13_scale is None or w2_scale is None:
            return []
        num_experts, _, hidden_size = w13.shape
        counts = warm_token_counts(top_k)
        for n in counts:
            hidden = torch.zeros(n, hidden_size, dtype=dtype, device=w13.device)
            ids = (torch.arange(n * top_k, device=w13.device) % num_experts).view(n, top_k)
            weights = torch.full((n, top_k), 1.0 / top_k, dtype=dtype, device=w13.device)
            fused_moe_fp8_block(hidden, w13, w2, ids, weights, w13_scale, w2_scale)
        return counts


BLOCK_FP8_EXPERTS = BlockFp8Experts()
