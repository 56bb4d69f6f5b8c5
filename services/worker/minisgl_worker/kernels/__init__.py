"""Triton kernels of the worker: paged attention (decode with split-K, prefill/extend), the KV
store, and the fused sampling draw.

Importing this package imports triton, so callers import it lazily: only CUDA paths, or CPU
tensors under TRITON_INTERPRET=1 (set before the first import; `@triton.jit` picks the
interpreter when it decorates).

KV layout (FlashInfer's paged NHD): k_cache, v_cache [num_pages, page_size, num_kv_heads,
head_dim], last dim contiguous; `page_table[row, i]` is the i-th page of the request in that row
(int32), so token t of a request lives at page_table[row, t // page_size], offset t % page_size.
"""
