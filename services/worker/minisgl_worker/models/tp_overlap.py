"""Tensor parallelism, large eager steps: NCCL's all-reduces run beside the GEMMs, rows in halves.

Why: a prefill chunk's row-parallel outputs are too big for the custom all-reduce (8 MiB; a
8,192-token chunk of Qwen3-8B is 64 MiB) and go through NCCL, during which nothing else runs: at
TP=2 on H100s 258 µs a call, 0.34 s of a 10 s offline run. Everything between two attention calls
is row-wise (norms, projections, the MLP or MoE), so a step's rows can go in two halves, each
half's partial sums summed asynchronously (NCCL on its own stream) while the other half computes:

    per half h: wait for x_h's sum; add + input norm; QKV projection   (x_1's sum under half 0)
    attention over every row (one call, as without halves)
    per half h: o_proj, its sum started at once                     (o_0's sum under o_proj(1))
    per half h: wait for o_h's sum; add + post norm; MLP; start its sum
                          (o_1's sum under half 0's MLP, m_0's under half 1's, m_1's under the
                           next layer's half 0)

A row gets what the whole-tensor path gives it (the GEMMs may pick other kernels for half the
rows: last-bit differences, as between batch sizes). `DecoderModel.forward` takes this path when
the step has at least `overlap_min_tokens` rows (0: never, the default until measured) and each
half is past the custom all-reduce; never while a CUDA graph is being captured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
from torch import nn

from ..attention.base import AttentionBackend
from ..distributed import all_reduce_start, tp
from ..layers.attention import SelfAttention
from ..layers.norm import RMSNorm

Half = tuple[torch.Tensor, Any]  # a half's partial sums and the handle of their all-reduce


class Layer(Protocol):
    """What this takes of a decoder layer (decoder.py's `DecoderLayer`)."""

    input_layernorm: RMSNorm
    self_attn: SelfAttention
    post_attention_layernorm: RMSNorm
    mlp: nn.Module


def applies(min_tokens: int, hidden: torch.Tensor) -> bool:
    """Whether a step with these embeddings [T, H] runs in halves."""
    state, rows = tp(), hidden.shape[0]
    if state.size == 1 or min_tokens <= 0 or rows < max(2, min_tokens):
        return False
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    fast = state.fast_all_reduce  # a half it would take is summed synchronously: no overlap
    return fast is None or not fast.supports(hidden[: rows // 2])


def _wait(handle: Any) -> None:
    if handle is not None:
        handle.wait()


def forward(layers: Sequence[Layer], final_norm: RMSNorm, hidden: torch.Tensor,
            positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
    """`DecoderModel.forward` from the embeddings (summed over the ranks already) to the final
    norm's output, the rows in two halves (see the module's note)."""
    rows = hidden.shape[0]
    halves = (slice(0, rows // 2), slice(rows // 2, rows))
    residual = [hidden[r] for r in halves]
    pending: list[Half] | None = None  # the previous layer's MLP output, halves in flight
    for layer in layers:
        qkv = []
        for i, r in enumerate(halves):
            if pending is None:  # the first layer: its input is the embeddings themselves
                h = layer.input_layernorm(hidden[r])
            else:
                part, handle = pending[i]
                _wait(handle)
                h, residual[i] = layer.input_layernorm.add_forward(part, residual[i])
            qkv.append(layer.self_attn.qkv_proj(h))
        out = layer.self_attn.attend(positions, torch.cat(qkv), attn)
        o_proj = layer.self_attn.o_proj
        sums: list[Half] = []
        for r in halves:
            part = o_proj(out[r])
            sums.append((part, all_reduce_start(part)))
        pending = []
        for i, (part, handle) in enumerate(sums):
            _wait(handle)
            h, residual[i] = layer.post_attention_layernorm.add_forward(part, residual[i])
            m = layer.mlp(h)
            pending.append((m, all_reduce_start(m)))
    assert pending is not None
    normed = []
    for i, (part, handle) in enumerate(pending):
        _wait(handle)
        normed.append(cast(torch.Tensor, final_norm.add_forward(part, residual[i])[0]))
    return torch.cat(normed)


__all__ = ["applies", "forward"]
