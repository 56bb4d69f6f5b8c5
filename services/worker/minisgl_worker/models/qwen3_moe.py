"""Qwen3-MoE: Qwen3 attention; sparse MoE blocks in place of the MLP, except on the layers
`mlp_only_layers` names (and those `decoder_sparse_step` skips), which keep a dense MLP.
Checkpoints store each expert separately (mlp.experts.{e}.{gate,up,down}_proj.weight); they load
into the stacked w13 / w2 tensors of `SparseMoeBlock`."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from ..layers.mlp import GatedMLP
from ..layers.moe import SparseMoeBlock
from ..model_config import ModelConfig
from .decoder import CausalLM

_EXPERT_RE = re.compile(r"^(.*\.mlp\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen3MoeForCausalLM(CausalLM):
    qkv_bias = False
    qk_norm = True

    def make_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        if not cfg.is_moe_layer(layer_id):
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        return SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                              cfg.num_experts_per_tok, cfg.norm_topk_prob)

    def weight_target(self, name: str) -> tuple[str, Any] | None:
        return expert_target(name) or super().weight_target(name)


def expert_target(name: str) -> tuple[str, tuple[int, int]] | None:
    """A per-expert checkpoint tensor (mlp.experts.{e}.{gate,up,down}_proj.weight) -> the
    stacked w13 / w2 parameter and its (expert, part) shard id; None for any other tensor."""
    m = _EXPERT_RE.match(name)
    if m is None:
        return None
    prefix, expert, kind = m.group(1), int(m.group(2)), m.group(3)
    if kind == "down_proj":
        return f"{prefix}w2", (expert, 0)
    return f"{prefix}w13", (expert, 0 if kind == "gate_proj" else 1)
