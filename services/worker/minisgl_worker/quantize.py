"""Online weight quantization of a loaded model (`--quantization fp8`), run by the loader.

Every dense projection (qkv, o, gate_up, down) and every MoE expert stack becomes fp8 rows with
one fp32 scale each (the format: fp8.py); the MoE router (a ReplicatedLinear) stays as loaded, its
logits pick the experts. A norm whose only consumer is an fp8 projection (a layer's input norm
before qkv; the post-attention norm before a dense MLP's gate_up) is swapped for one that
quantizes its output itself where that projection would (one kernel instead of two): the routing
is decided here, once, not by the decoder layer on every step.
"""

from __future__ import annotations

from torch import nn

from .config import QUANTIZATIONS
from .layers.linear import ColumnParallelLinear, RowParallelLinear
from .layers.mlp import GatedMLP
from .layers.moe import SparseMoeBlock
from .layers.norm import Fp8FeedingRMSNorm
from .models.decoder import DecoderLayer


def quantize_model(model: nn.Module, method: str) -> int:
    """Quantize every dense projection and MoE expert stack of `model` in place; the count of
    modules quantized."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    if method == "none":
        return 0
    kinds = ColumnParallelLinear | RowParallelLinear | SparseMoeBlock
    targets = [m for m in model.modules() if isinstance(m, kinds)]
    for m in targets:
        m.quantize_fp8()
    for layer in [m for m in model.modules() if isinstance(m, DecoderLayer)]:
        _feed_fp8_norms(layer)
    return len(targets)


def _feed_fp8_norms(layer: DecoderLayer) -> None:
    """The MoE block's router needs the unquantized rows: its post-attention norm stays plain.
    So does the input norm of an attention without one packed qkv_proj (DeepSeek's latent
    attention feeds two projections, one of them replicated and unquantized)."""
    qkv = getattr(layer.self_attn, "qkv_proj", None)
    if isinstance(qkv, ColumnParallelLinear):
        layer.input_layernorm = Fp8FeedingRMSNorm(layer.input_layernorm, qkv)
    if isinstance(layer.mlp, GatedMLP):  # a sandwich layer's post-attention norm feeds the sum
        name = layer.mlp_input_norm
        setattr(layer, name, Fp8FeedingRMSNorm(getattr(layer, name), layer.mlp.gate_up_proj))
