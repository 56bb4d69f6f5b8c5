"""Compiles the worker's Triton kernels for an H100 (sm_90) on a machine without a GPU.

The CPU tests run these kernels in Triton's interpreter, which skips what only a GPU build has:
programmatic dependent launch (griddepcontrol), inline PTX (%globaltimer, trap), system-scope
atomics, volatile loads, fp8 tensor-core products, wgmma pipelines. Here Triton lowers each kernel
to PTX and ptxas (shipped in the triton wheel) assembles it for sm_90, as on the GPU machine, with
the variants the worker launches there (PDL on). Run as a script, without TRITON_INTERPRET:
`python tests/worker/sm90_compile.py [WORD...]` prints one line a case (those whose name holds a
WORD, or all) and exits non-zero if one fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # before the kernels are decorated

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


@dataclass
class Case:
    module: str  # under minisgl_worker.kernels
    kernel: str
    constexprs: dict[str, Any]
    ptrs: dict[str, str] = field(default_factory=dict)  # pointer arguments not *bf16
    scalars: dict[str, str] = field(default_factory=dict)  # scalar arguments not i32
    options: dict[str, Any] = field(default_factory=lambda: {"num_warps": 4})
    # arguments the launcher would see as multiples of 16 (pointers: 16-byte aligned), as
    # Triton specializes them at run time: what lets loads vectorize and pipeline
    divisible: tuple[str, ...] = ()  # names the kernel lacks are ignored
    aligned: tuple[str, ...] = ()  # arguments a launch specializes as multiples of 16 (pointers,
    # strides): without it 2-byte loads look unaligned and cp.async pipelining is not exercised
    ptx_has: tuple[str, ...] = ()  # regexes the PTX must match (e.g. vectorized loads)
    ptx_lacks: tuple[str, ...] = ()  # regexes it must not (e.g. flush-to-zero multiplies)
    no_spills: bool = False  # fail on any local memory (register spills)

    @property
    def name(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.constexprs.items() if k != "USE_PDL")
        return f"{self.module}.{self.kernel}({shown})"


_DELTAS = {f"d{i}": "i64" for i in range(8)}
_PDL = {"USE_PDL": True}
_DECODE = dict(PAGE_SIZE=64, GROUP=4, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64,
               PRECISION="tf32", NUM_KV_HEADS=8, **_PDL)
_DECODE_PTRS = {"page_table_ptr": "*i32", "rows_ptr": "*i32", "seq_lens_ptr": "*i32",
                "order_ptr": "*i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}
_FP8 = "*fp8e4nv"

_MOE_TILE_PTRS = {"sorted_ptr": "*i32", "expert_of_block_ptr": "*i32", "num_padded_ptr": "*i32"}
_W4_PTRS = {"q_ptr": "*i32", "perm_ptr": "*i32", "gidx_ptr": "*i32", "ws_ptr": "*fp32",
            "cnt_ptr": "*i32"}


def _gate_up_case(tile: dict[str, Any], fp8: bool, warps: int, stages: int,
                  scalars: dict[str, str] | None = None) -> Case:
    """fused_moe_kernels.gate_up_kernel with BLOCK_K 128 and `tile`'s other constexprs."""
    x = _FP8 if fp8 else "*bf16"
    return Case("fused_moe_kernels", "gate_up_kernel",
                {"TOPK": 8, "BLOCK_K": 128, "EVEN_K": True, "PRECISION": "tf32", "FP8": fp8,
                 **tile, **_PDL},
                {"x_ptr": x, "w_ptr": x, "x_scale_ptr": "*fp32", "scale_ptr": "*fp32",
                 **_MOE_TILE_PTRS}, scalars or {}, {"num_warps": warps, "num_stages": stages})


def _down_case(tile: dict[str, Any], warps: int, stages: int) -> Case:
    """fused_moe_kernels.down_kernel (bf16) with BLOCK_K 64 and `tile`'s other constexprs."""
    return Case("fused_moe_kernels", "down_kernel",
                {"BLOCK_K": 64, "EVEN_K": True, "PRECISION": "tf32", "FP8": False, **tile,
                 **_PDL},
                {"a_scale_ptr": "*fp32", "scale_ptr": "*fp32", "weights_ptr": "*fp32",
                 **_MOE_TILE_PTRS}, {}, {"num_warps": warps, "num_stages": stages})


_MXFP4_PTRS = {"w_ptr": "*u8", "s_ptr": "*u8", **_MOE_TILE_PTRS}
# gpt-oss shapes (H = I = 2880): every stride but the scales' rows (H / 32 = 90) is a multiple
# of 16; so are the pointers
_MXFP4_DIV = ("x_ptr", "a_ptr", "w_ptr", "s_ptr", "out_ptr", "weights_ptr", "b_ptr", "sorted_ptr",
              "expert_of_block_ptr", "num_padded_ptr", "hidden", "inter", "stride_xt",
              "stride_at", "stride_we", "stride_wn", "stride_se", "stride_ot", "stride_be")


def _mxfp4_cases(tile: tuple[int, int, int, int, int], swap: bool, asm: bool, even: bool,
                 dtype: str = "*bf16", gpt_oss: bool = True,
                 kernels: tuple[str, ...] = ("gate_up_kernel", "down_kernel")) -> list[Case]:
    """moe_mxfp4_kernels' two GEMMs with tile (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), as
    moe_mxfp4.choose_config picks them; gpt_oss: biases and the clamped SwiGLU."""
    bm, bn, bk, warps, stages = tile
    out = []
    for kernel in kernels:
        up = kernel == "gate_up_kernel"
        consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1 if swap else 4,
                  "EVEN_K": even, "PRECISION": "tf32", "SWAP_AB": swap, "ASM": asm,
                  "HAS_BIAS": gpt_oss, **({"TOPK": 4, "CLAMPED": gpt_oss} if up else {}), **_PDL}
        ptrs = {**_MXFP4_PTRS, "out_ptr": dtype, "b_ptr": dtype,
                **({"x_ptr": dtype} if up else {"a_ptr": dtype, "weights_ptr": "*fp32"})}
        scalars = {"alpha": "fp32", "limit": "fp32"} if up else {}
        out.append(Case("moe_mxfp4_kernels", kernel, consts, ptrs, scalars,
                        {"num_warps": warps, "num_stages": stages}, _MXFP4_DIV))
    return out


# MXFP4 experts (moe_mxfp4_kernels.py): decode tiles (SWAP_AB, K 128: H = 2880 leaves a partial
# last step) with the PTX upcast and the float one, fp16; prefill tiles (K 64, even).
_MXFP4_CASES = [
    *_mxfp4_cases((16, 64, 128, 4, 4), True, True, False),
    *_mxfp4_cases((16, 64, 128, 4, 3), True, False, True),
    *_mxfp4_cases((16, 64, 128, 4, 3), True, False, False, "*fp16", kernels=("gate_up_kernel",)),
    *_mxfp4_cases((32, 128, 64, 4, 3), False, True, True),
    *_mxfp4_cases((128, 128, 64, 8, 3), False, True, True),
    *_mxfp4_cases((64, 128, 64, 8, 3), False, False, False, "*fp16", gpt_oss=False),
]


def _mxfp4_gemv_case(gate_up: bool, block_p: int, block_n: int, block_k: int, warps: int,
                     even: bool = True, dtype: str = "*bf16") -> Case:
    """moe_mxfp4_gemv.mxfp4_gemv_kernel (the decode path) for gpt-oss: biases, clamped SwiGLU;
    its codes must come in 128-bit loads, its fp32 multiplies keep subnormals, nothing spills."""
    consts = {"TOPK": 4, "GATE_UP": gate_up, "ALIGNED": block_p > 1, "BLOCK_P": block_p,
              "BLOCK_N": block_n, "BLOCK_K": block_k, "EVEN_K": even, "HAS_BIAS": True,
              "CLAMPED": gate_up, **_PDL}
    ptrs = {"x_ptr": dtype, "w_ptr": "*i32", "s_ptr": "*u8", "out_ptr": dtype, "ids_ptr": "*i64",
            "sorted_ptr": "*i32", "expert_of_block_ptr": "*i32", "num_padded_ptr": "*i32",
            "weights_ptr": dtype, "b_ptr": dtype}
    # H = I = 2880: row strides of 360 words, 90 scale bytes
    div = ("x_ptr", "w_ptr", "s_ptr", "out_ptr", "b_ptr", "n_out", "k_in", "stride_xt",
           "stride_we", "stride_wn", "stride_se", "stride_ot", "stride_be")
    return Case("moe_mxfp4_gemv", "mxfp4_gemv_kernel", consts, ptrs,
                {"alpha": "fp32", "limit": "fp32"}, {"num_warps": warps, "num_stages": 1}, div,
                ptx_has=(r"ld\.global(\.\w+)*\.v4\.b32",), ptx_lacks=(r"mul(\.\w+)*\.ftz",),
                no_spills=True)


_MXFP4_GEMV_CASES = [
    _mxfp4_gemv_case(True, 1, 16, 256, 4),
    _mxfp4_gemv_case(False, 1, 16, 256, 4),
    _mxfp4_gemv_case(True, 2, 16, 256, 4),
    _mxfp4_gemv_case(False, 2, 16, 256, 4),
    _mxfp4_gemv_case(True, 2, 32, 128, 4, even=False),
    _mxfp4_gemv_case(True, 1, 32, 512, 8, even=False),
    _mxfp4_gemv_case(False, 1, 16, 256, 4, dtype="*fp16"),
]

CASES = [
    Case("all_reduce_kernels", "barrier_all_reduce", {"WORLD": 2, "BLOCK": 1024},
         {"flag_ptrs": "*i64", "counter_ptr": "*i32"}, _DELTAS),
    Case("all_reduce_kernels", "barrier_all_reduce_rmsnorm", {"WORLD": 8, "BLOCK": 4096},
         {"flag_ptrs": "*i64", "counter_ptr": "*i32"}, {**_DELTAS, "eps": "fp32"},
         {"num_warps": 8}),
    Case("all_reduce_kernels", "lamport_all_reduce",
         {"RANK": 0, "WORLD": 2, "BLOCK": 1024, "BITS": 16, **_PDL},
         {"counter_ptr": "*i32"}, _DELTAS),
    Case("all_reduce_kernels", "lamport_all_reduce",
         {"RANK": 3, "WORLD": 4, "BLOCK": 1024, "BITS": 32, **_PDL},
         {"x_ptr": "*fp32", "buf_ptr": "*fp32", "counter_ptr": "*i32"}, _DELTAS),
    Case("all_reduce_kernels", "lamport_all_reduce_rmsnorm",
         {"RANK": 1, "WORLD": 2, "BLOCK": 4096, "BITS": 16, **_PDL},
         {"counter_ptr": "*i32"}, {**_DELTAS, "eps": "fp32"}, {"num_warps": 8, "maxnreg": 128}),
    Case("two_shot", "two_shot_all_reduce_rmsnorm", {"RANK": 0, "WORLD": 2, "BLOCK": 4096},
         {"flag_ptrs": "*i64", "counter_ptr": "*i32"}, {**_DELTAS, "eps": "fp32"},
         {"num_warps": 8}),
    Case("two_shot", "two_shot_all_reduce_rmsnorm", {"RANK": 2, "WORLD": 4, "BLOCK": 1024},
         {"x_ptr": "*fp32", "res_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32",
          "buf_ptr": "*fp32", "flag_ptrs": "*i64", "counter_ptr": "*i32"},
         {**_DELTAS, "eps": "fp32"}),
    Case("paged_decode", "_decode_split_kernel", {**_DECODE, "MMA_FP16": False, "DIRECT": False},
         _DECODE_PTRS, {"qk_scale": "fp32"}, {"num_warps": 4, "num_stages": 3}),
    Case("paged_decode", "_decode_split_kernel",
         {**_DECODE, "MMA_FP16": True, "DIRECT": True, "ORDERED": True},
         {**_DECODE_PTRS, "k_ptr": _FP8, "v_ptr": _FP8}, {"qk_scale": "fp32"},
         {"num_warps": 4, "num_stages": 3}),
    Case("paged_decode", "_decode_merge_kernel",
         {"HEAD_DIM": 128, "BLOCK_S": 32, "BLOCK_D": 128, "BLOCK_N": 64, **_PDL},
         {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "seq_lens_ptr": "*i32"}),
    Case("fused_kernels", "_gemv_kernel",
         {"HAS_BIAS": False, "HAS_SCALE": False, "SILU_MUL": True, "BLOCK_N": 2,
          "BLOCK_K": 1024, **_PDL}, {"s_ptr": "*fp32"}),
    Case("fused_kernels", "_gemv_kernel",
         {"HAS_BIAS": True, "HAS_SCALE": True, "SILU_MUL": False, "BLOCK_N": 2,
          "BLOCK_K": 1024, **_PDL}, {"w_ptr": _FP8, "s_ptr": "*fp32"}),
    Case("fused_kernels", "_gemv_kernel",  # INT8 W8A8 checkpoints' one-row product
         {"HAS_BIAS": False, "HAS_SCALE": True, "SILU_MUL": True, "BLOCK_N": 2,
          "BLOCK_K": 1024, **_PDL}, {"w_ptr": "*i8", "s_ptr": "*fp32"}),
    Case("fused_kernels", "_gemv_kernel",  # block-FP8 checkpoints: scales per 128-group
         {"HAS_BIAS": False, "HAS_SCALE": True, "SILU_MUL": False, "BLOCK_N": 8,
          "BLOCK_K": 1024, "SCALE_GROUP": 128, **_PDL}, {"w_ptr": _FP8, "s_ptr": "*fp32"}),
    Case("fused_kernels", "_rmsnorm_kernel",
         {"HAS_RES": True, "BLOCK": 4096, "QUANT": True, "QMAX": 448.0, **_PDL},
         {"out_ptr": _FP8, "scale_ptr": "*fp32"}, {"eps": "fp32"}, {"num_warps": 8}),
    Case("fused_kernels", "_silu_mul_kernel", {"BLOCK": 1024, **_PDL}),
    Case("fused_kernels", "_qk_norm_rope_store_kernel",
         {"HQ": 32, "HK": 8, "HALF": 64, "PAGE_SIZE": 64, "HAS_NORM": True, "TOKENS": 1,
          "BLOCK_HQ": 32, "BLOCK_HK": 8, "BLOCK_D": 128, "BLOCK_HALF": 64, "CACHE_MAX": 0.0,
          **_PDL},
         {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "loc_ptr": "*i64"},
         {"eps": "fp32"}),
    Case("fused_kernels", "_quant_rows_kernel",
         {"QMAX": 448.0, "SILU_MUL": False, "BLOCK": 4096, "ONE_PASS": True, **_PDL},
         {"q_ptr": _FP8, "s_ptr": "*fp32"}),
    Case("paged_extend", "_extend_kernel",
         {"PAGE_SIZE": 64, "GROUP": 4, "HEAD_DIM": 128, "BLOCK_M": 64, "BLOCK_N": 32,
          "BLOCK_D": 128, "PRECISION": "tf32"},
         {"page_table_ptr": "*i32", "rows_ptr": "*i32", "cu_q_ptr": "*i32",
          "prefix_ptr": "*i32"}, {"qk_scale": "fp32"}),
    Case("store_kv", "_store_kv_kernel",
         {"PAGE_SIZE": 64, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128,
          "CACHE_MAX": 448.0}, {"k_cache_ptr": _FP8, "v_cache_ptr": _FP8, "loc_ptr": "*i64"}),
    Case("sampling", "_gumbel_argmax_kernel", {"HAS_TEMP": True, "TOK_TABLE": True,
                                               "BLOCK": 4096},
         {"seeds_ptr": "*i64", "positions_ptr": "*i64", "temps_ptr": "*fp32",
          "tok_hash_ptr": "*i32", "part_val_ptr": "*fp32", "part_idx_ptr": "*i32"}),
    Case("sampling", "_gumbel_argmax_kernel", {"HAS_TEMP": False, "TOK_TABLE": False,
                                               "BLOCK": 1024, "GREEDY": True},
         {"part_val_ptr": "*fp32", "part_idx_ptr": "*i64"}),
    Case("sampling", "_best_chunk_kernel", {"BLOCK_C": 64},
         {"part_val_ptr": "*fp32", "part_idx_ptr": "*i64", "val_ptr": "*fp32",
          "idx_ptr": "*i64"}, {}, {"num_warps": 1}),
    Case("sampling", "_pack_slot_kernel", {"WORLD": 2, "BLOCK": 256},
         {"val_ptr": "*fp32", "idx_ptr": "*i64", "buf_ptr": "*fp32"}),
    Case("sampling", "_pick_ranks_kernel", {"WORLD": 2, "BLOCK": 256},
         {"buf_ptr": "*fp32", "out_ptr": "*i64"}),
    Case("fused_kernels", "_embedding_shard_kernel", {"BLOCK": 4096, **_PDL},
         {"ids_ptr": "*i64"}, {}, {"num_warps": 8}),
    Case("moe_ops", "_route_topk_kernel",
         {"TOP_K": 8, "NORM": True, "BLOCK_T": 16, "BLOCK_E": 128, "BLOCK_K": 8, **_PDL},
         {"ids_ptr": "*i64"}),
    Case("moe_ops", "_sum_over_k_kernel", {"TOP_K": 8, "BLOCK_H": 1024, **_PDL}),
    Case("fused_moe_kernels", "align_single_kernel",
         {"E_PAD": 128, "BLOCK_M": 16, "BLOCK": 64, "BLOCK_B": 64, **_PDL},
         {"ids_ptr": "*i64", "sorted_ptr": "*i32", "expert_of_block_ptr": "*i32",
          "num_padded_ptr": "*i32"}),
    Case("fused_moe_kernels", "count_kernel", {"E_PAD": 128, "BLOCK": 64, **_PDL},
         {"ids_ptr": "*i64", "counts_ptr": "*i32"}),
    Case("fused_moe_kernels", "plan_kernel",
         {"E_PAD": 128, "BLOCK_M": 32, "BLOCK_B": 64, **_PDL},
         {"counts_ptr": "*i32", "cursor_ptr": "*i32", "sorted_ptr": "*i32",
          "expert_of_block_ptr": "*i32", "num_padded_ptr": "*i32"}, {}, {"num_warps": 8}),
    Case("fused_moe_kernels", "place_kernel", {"BLOCK": 64, **_PDL},
         {"ids_ptr": "*i64", "cursor_ptr": "*i32", "sorted_ptr": "*i32"}),
    *(_gate_up_case(dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=4), fp8, 4, 4) for fp8 in (False, True)),
    _down_case(dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=4), 4, 3),
    # Decode tiles, transposed (SWAP_AB): weight columns on wgmma's M side.
    *(_gate_up_case(dict(BLOCK_M=16, BLOCK_N=128, GROUP_M=1, SWAP_AB=True), fp8, 8, 3)
      for fp8 in (False, True)),
    _down_case(dict(BLOCK_M=32, BLOCK_N=256, GROUP_M=1, SWAP_AB=True), 8, 3),
    # gpt-oss experts: biases and the clamped SwiGLU (alpha, limit: fp32 scalars)
    *(_gate_up_case(dict(BLOCK_M=16, BLOCK_N=128, GROUP_M=1, SWAP_AB=swap, HAS_BIAS=True,
                         CLAMPED=True), fp8, 8, 3, {"alpha": "fp32", "limit": "fp32"})
      for swap, fp8 in ((True, False), (False, True))),
    _down_case(dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=4, HAS_BIAS=True), 4, 3),
    # W4A16 (w4a16_kernels.py, moe_w4a16_kernels.py): GEMV with split-K counters, GEMM on
    # mma.sync (16 rows) and wgmma (128 rows), act-order gathers, MoE gate_up and down.
    *(Case("w4a16_kernels", "w4_gemv_kernel",
           {"G": g, "HAS_ZEROS": z, "HAS_PERM": not z, "EVEN_K": z, "EVEN_N": z, "BLOCK_M": 1,
            "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": split > 1, **_PDL},
           {k: v for k, v in _W4_PTRS.items() if k != "gidx_ptr"})
      for g, z, split in ((128, True, 4), (32, False, 1))),
    *(Case("w4a16_kernels", "w4_gemm_kernel",
           {"G": 128, "HAS_ZEROS": True, "HAS_PERM": gidx, "HAS_GIDX": gidx, "EVEN_K": True,
            "EVEN_N": True, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8,
            "SPLIT_K": split > 1, "PRECISION": "tf32", **_PDL}, _W4_PTRS, {},
           {"num_warps": warps, "num_stages": 3})
      for bm, bn, bk, warps, split, gidx in ((16, 64, 128, 4, 3, False),
                                             (128, 128, 64, 8, 1, False),
                                             (16, 64, 128, 4, 1, True))),
    # The dense GEMM (w4a16_mma.py): decode tile with split-K and reordered x, prefill tiles,
    # the in-kernel gather (act-order perm), gidx, fp16.
    *(Case("w4a16_mma", "w4_mma_kernel",
           {"G": g, "HAS_ZEROS": z, "HAS_PERM": gather, "HAS_GIDX": gidx,
            "X_PERMUTED": not gather, "EVEN_K": True, "EVEN_N": True, "BLOCK_M": bm,
            "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "SPLIT_K": split, **_PDL},
           {**_W4_PTRS, "q_ptr": "*i16", **({"x_ptr": "*fp16", "s_ptr": "*fp16", "z_ptr": "*fp16",
                                            "out_ptr": "*fp16"} if fp16 else {})}, {},
           {"num_warps": warps, "num_stages": stages},
           aligned=("N", "K", "stride_x", "stride_q", "stride_s", "stride_o"))
      for g, z, bm, bn, bk, warps, stages, split, gather, gidx, fp16 in (
          (128, True, 16, 64, 128, 4, 4, True, False, False, False),
          (128, False, 64, 128, 128, 4, 4, False, False, False, False),
          (128, True, 128, 128, 64, 8, 4, False, False, False, False),
          (128, False, 128, 256, 64, 8, 3, False, False, False, False),
          (32, True, 16, 64, 128, 4, 4, False, True, False, True),
          (128, True, 16, 64, 128, 4, 3, False, True, True, False))),
    # ... with the packed dequantization's inline PTX (w4a16_packed.py): decode tile with
    # split-K (also M=1's candidate), prefill tiles, the gather, gidx, fp16.
    *(Case("w4a16_mma", "w4_mma_kernel",
           {"G": g, "HAS_ZEROS": z, "HAS_PERM": gather, "HAS_GIDX": gidx,
            "X_PERMUTED": not gather, "EVEN_K": True, "EVEN_N": True, "BLOCK_M": bm,
            "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "SPLIT_K": split, "PACKED": True,
            "ASM": True, **_PDL},
           {**_W4_PTRS, "q_ptr": "*i16", **({"x_ptr": "*fp16", "s_ptr": "*fp16", "z_ptr": "*fp16",
                                            "out_ptr": "*fp16"} if fp16 else {})}, {},
           {"num_warps": warps, "num_stages": stages},
           aligned=("N", "K", "stride_x", "stride_q", "stride_s", "stride_o"))
      for g, z, bm, bn, bk, warps, stages, split, gather, gidx, fp16 in (
          (128, True, 16, 64, 128, 4, 4, True, False, False, False),
          (128, False, 16, 128, 256, 4, 3, True, True, False, False),
          (128, False, 64, 128, 128, 4, 4, False, False, False, False),
          (128, True, 128, 128, 64, 8, 4, False, False, False, False),
          (128, False, 128, 256, 64, 8, 3, False, False, False, False),
          (32, True, 16, 64, 128, 4, 4, False, True, False, True),
          (128, True, 16, 64, 128, 4, 3, False, True, True, False))),
    *(Case("moe_w4a16_kernels", "moe_w4_kernel",
           {"G": 128, "HAS_ZEROS": not up, "A_DIV": 8 if up else 1, "GATE_UP": up,
            "EVEN_K": True, "EVEN_N": True, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128,
            "GROUP_M": 1, "PRECISION": "tf32", **_PDL}, {"q_ptr": "*i32", **_MOE_TILE_PTRS})
      for up, bm, bn in ((True, 16, 32), (False, 64, 128))),
    *_MXFP4_CASES,
    *_MXFP4_GEMV_CASES,
    Case("fp8_gemm", "_fp8_gemm_kernel",
         {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "ACC_MODE": 1, **_PDL},
         {"a_ptr": _FP8, "b_ptr": _FP8, "sa_ptr": "*fp32", "sb_ptr": "*fp32"}, {},
         {"num_warps": 4, "num_stages": 4}),
]


def resources(cubin: bytes) -> str:
    """Registers and local memory (spills) a thread, from cuobjdump (shipped beside ptxas)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True,
                              text=True).stdout
    use = dict(re.findall(r"(REG|LOCAL|SHARED):(\d+)", text))
    return f"{use.get('REG', '?')} registers, {use.get('LOCAL', '?')} bytes local (spills)"


def compile_case(case: Case) -> tuple[int, str]:
    """The size of the sm_90 binary and its resources; raises what Triton or ptxas raised."""
    import importlib

    module = importlib.import_module(f"minisgl_worker.kernels.{case.module}")
    fn = getattr(module, case.kernel)
    names = fn.arg_names
    unknown = set(case.constexprs) | set(case.ptrs) | set(case.scalars)
    unknown -= set(names)
    if unknown:
        raise ValueError(f"{case.kernel} has no arguments {sorted(unknown)}")
    params = {p.name: p for p in fn.params}
    signature, constexprs, attrs = {}, {}, {}
    for i, n in enumerate(names):
        if params[n].is_constexpr:  # given, or its default
            signature[n] = "constexpr"
            constexprs[(i,)] = case.constexprs.get(n, params[n].default)
        elif n in case.constexprs:
            raise ValueError(f"{case.kernel}: {n} is not a constexpr")
        elif n.endswith("_ptr") or n.endswith("_ptrs"):
            signature[n] = case.ptrs.get(n, "*bf16")
        else:
            signature[n] = case.scalars.get(n, "i32")
        if n in case.divisible or n in case.aligned or (case.aligned and n.endswith("_ptr")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=case.options)
    ptx = out.asm["ptx"]
    if case.constexprs.get("USE_PDL") and "griddepcontrol.wait" not in ptx:
        raise AssertionError(f"{case.kernel}: USE_PDL=True but no griddepcontrol.wait in its PTX")
    if case.constexprs.get("ASM") and case.module == "w4a16_mma":  # the packed dequantization
        ftype = "f16" if case.ptrs.get("x_ptr") == "*fp16" else "bf16"
        for op in ("lop3.b32", f"fma.rn.{ftype}x2"):
            if op not in ptx:
                raise AssertionError(f"{case.kernel}: ASM=True but no {op} in its PTX")
    for pattern in case.ptx_has:
        if not re.search(pattern, ptx):
            raise AssertionError(f"{case.kernel}: no /{pattern}/ in its PTX")
    for pattern in case.ptx_lacks:
        if re.search(pattern, ptx):
            raise AssertionError(f"{case.kernel}: /{pattern}/ in its PTX")
    use = resources(out.asm["cubin"])
    if case.no_spills and not use.endswith(" 0 bytes local (spills)"):
        raise AssertionError(f"{case.kernel}: spills ({use})")
    return len(out.asm["cubin"]), use


def main(argv: list[str] | None = None) -> int:
    """Every case, or those whose name contains one of argv's words."""
    words = sys.argv[1:] if argv is None else argv
    cases = [c for c in CASES if not words or any(w in c.name for w in words)]
    failed = 0
    for case in cases:
        try:
            size, use = compile_case(case)
            print(f"ok {case.name}: {size} bytes of sm_90 code, {use}")
        except Exception:  # noqa: BLE001 (every failure is reported, then the exit code)
            failed += 1
            print(f"FAILED {case.name}")
            traceback.print_exc()
    print(f"{len(cases)} cases, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
