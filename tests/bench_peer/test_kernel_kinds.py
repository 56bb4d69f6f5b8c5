"""bench/profile/kernels.py: kernel names of both engines land in the kind a reader expects, so
the side-by-side profile compares like with like."""

from __future__ import annotations

import pytest

from bench.profile.kernels import KINDS, by_kind, kind_of, report


@pytest.mark.parametrize(("name", "kind"), [
    # ours (Triton kernels of services/worker/minisgl_worker/kernels)
    ("_decode_split_kernel", "attention"),
    ("_decode_merge_kernel", "attention"),
    ("_extend_kernel", "attention"),
    ("_qk_norm_rope_store_kernel", "prologue"),
    ("_one_shot_all_reduce_rmsnorm", "all_reduce"),
    ("_rmsnorm_kernel", "norm"),
    ("_silu_mul_kernel", "activation"),
    ("_gemv_kernel", "gemm"),
    ("_gumbel_argmax_kernel", "sampling"),
    ("gate_up_kernel", "moe"),
    ("_route_topk_kernel", "moe"),  # the router, not sampling's top-k
    ("_sum_over_k_kernel", "moe"),
    ("void vllm::moe::topk_softmax<...>", "moe"),
    ("_quant_rows_kernel", "quantize"),
    # FlashInfer, cuBLAS, NCCL
    ("void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>", "attention"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_reduce"),
    # vLLM: FA3, its CUDA ops, torch.compile'd Triton kernels
    ("void flash::FlashAttnFwdSm90<...>", "attention"),
    ("void vllm::reshape_and_cache_flash_kernel<...>", "prologue"),
    ("void vllm::rotary_embedding_kernel<...>", "prologue"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
    ("triton_poi_fused_mul_silu_slice_1", "activation"),
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>", "all_reduce"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>>", "memory"),
    ("some_unknown_kernel", "other"),
])
def test_kind_of(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_by_kind_and_report() -> None:
    times = {"_decode_split_kernel": 2.0, "_decode_merge_kernel": 0.5, "nvjet_x": 1.0,
             "mystery": 0.25}
    kinds = by_kind(times)
    assert set(kinds) == set(KINDS)
    assert (kinds["attention"], kinds["gemm"], kinds["other"], kinds["norm"]) == \
        (2.5, 1.0, 0.25, 0.0)
    rec = report(times, wall_s=5.0, rows=2)
    assert (rec["gpu_busy_s"], rec["gpu_idle_pct"]) == (3.75, 25.0)
    assert rec["top_kernels"] == [("attention", "_decode_split_kernel", 2.0),
                                  ("gemm", "nvjet_x", 1.0)]
