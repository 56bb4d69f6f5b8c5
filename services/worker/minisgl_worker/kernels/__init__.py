"""Every Triton kernel of the worker and its launcher: paged attention (decode with split-K,
prefill/extend), the KV store, the fused sampling draw, the fused elementwise ops and GEMV
(fused_ops.py launches fused_kernels.py), the fp8 GEMM, the MoE grouped GEMMs (fused_moe.py
launches fused_moe_kernels.py), the TP all-reduce over CUDA IPC buffers (all_reduce.py launches
all_reduce_kernels.py), and programmatic dependent launch (pdl.py).

This package and the launchers fused_ops.py and fused_moe.py never import triton; every other
module here does, so callers import them lazily: only CUDA paths, or CPU tensors under
TRITON_INTERPRET=1 (set before the first import; `@triton.jit` picks the interpreter when it
decorates).

KV layout (FlashInfer's paged NHD): k_cache, v_cache [num_pages, page_size, num_kv_heads,
head_dim], last dim contiguous; `page_table[row, i]` is the i-th page of the request in that row
(int32), so token t of a request lives at page_table[row, t // page_size], offset t % page_size.
"""
