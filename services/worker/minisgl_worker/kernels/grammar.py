"""Grammar bitmask -> -inf logits, in place (see sampling/grammar_mask.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bitmask_kernel(x_ptr, x_stride, rows_ptr, bits_ptr, bits_stride, vocab,
                   BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    row = tl.load(rows_ptr + i)
    words = tl.load(bits_ptr + i * bits_stride + cols // 32, mask=inside, other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    ptrs = x_ptr + row * x_stride + cols
    tl.store(ptrs, float("-inf"), mask=inside & ~allowed)
