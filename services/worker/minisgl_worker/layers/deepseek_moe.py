"""DeepSeek-V2 / V3 mixture of experts: the router, and the block that adds shared experts.

Routing (`RouterSpec`, as HF transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter compute
it, in fp32 over an fp32 router weight):
    V2: scores = softmax(logits); top-k of them ("greedy"), or top-k within the `topk_group`
        groups of experts whose best score is highest ("group_limited_greedy"; the other
        groups' scores count as 0).
    V3 ("noaux_tc"): scores = sigmoid(logits); the experts are chosen on scores +
        e_score_correction_bias (a load-balancing bias), within the `topk_group` groups whose
        two best biased scores sum highest; their weights are the unbiased scores, optionally
        renormalised (`norm_topk_prob`, + 1e-20).
    Both: weights * routed_scaling_factor.

The routed experts are `SparseMoeBlock`'s stacked w13 / w2 (TP splits each expert's
intermediate dimension) run by its `experts_fn`; the shared experts are one dense SwiGLU MLP
of n_shared * moe_intermediate_size, added to the routed output, its partial sums reduced with
the experts' in one all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import all_reduce
from .mlp import GatedMLP
from .moe import SparseMoeBlock
from .weights import default_loader, set_loader

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    scoring: str  # "softmax" (V2) or "sigmoid" (V3)
    method: str  # one of TOPK_METHODS
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    scaling: float = 1.0  # routed_scaling_factor

    def __post_init__(self) -> None:
        if (self.scoring, self.method) not in (("softmax", "greedy"),
                                              ("softmax", "group_limited_greedy"),
                                              ("sigmoid", "noaux_tc")):
            raise ValueError(f"DeepSeek routing with scoring_func={self.scoring!r} and "
                             f"topk_method={self.method!r} is not supported")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"config.json n_group={self.n_group} / topk_group="
                             f"{self.topk_group} do not split {self.num_experts} experts")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in "
                             f"[1, {self.num_experts}]")


def _group_mask(choice: torch.Tensor, spec: RouterSpec, group_score: torch.Tensor) -> torch.Tensor:
    """bool [T, E]: the experts of the `topk_group` best groups by `group_score` [T, G]."""
    best = torch.topk(group_score, spec.topk_group, dim=-1, sorted=False).indices
    groups = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
    per_group = spec.num_experts // spec.n_group
    return groups.unsqueeze(-1).expand(-1, -1, per_group).reshape(choice.shape)


def route(logits: torch.Tensor, spec: RouterSpec,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (fp32) -> (weights [T, K] fp32, expert ids [T, K] int64)."""
    t, g = logits.shape[0], spec.n_group
    if spec.scoring == "softmax":
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if spec.method == "group_limited_greedy":
            group_best = scores.view(t, g, -1).max(dim=-1).values
            scores = scores.masked_fill(~_group_mask(scores, spec, group_best), 0.0)
        weights, ids = torch.topk(scores, spec.top_k, dim=-1, sorted=False)
    else:
        scores = logits.float().sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        group_top2 = choice.view(t, g, -1).topk(2, dim=-1).values.sum(dim=-1)
        choice = choice.masked_fill(~_group_mask(choice, spec, group_top2), float("-inf"))
        ids = torch.topk(choice, spec.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)  # the bias picks experts, never weighs them
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.scaling, ids


class DeepseekRouter(nn.Module):
    """The gate: an fp32 [E, H] weight (kept in fp32 whatever the model's dtype, as HF keeps
    it) and, for V3, the fp32 e_score_correction_bias [E]."""

    def __init__(self, hidden_size: int, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        e = spec.num_experts
        self.weight = set_loader(nn.Parameter(torch.empty(e, hidden_size, dtype=torch.float32),
                                              requires_grad=False), default_loader)
        self.e_score_correction_bias = (
            set_loader(nn.Parameter(torch.empty(e, dtype=torch.float32), requires_grad=False),
                       default_loader) if spec.scoring == "sigmoid" else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        return route(logits, self.spec, self.e_score_correction_bias)


class DeepseekMoeBlock(SparseMoeBlock):
    """Routed experts (SparseMoeBlock's stacked weights and experts function) with the
    DeepSeek router, plus the shared experts."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, spec: RouterSpec,
                 n_shared_experts: int) -> None:
        super().__init__(hidden_size, moe_intermediate_size, spec.num_experts, spec.top_k,
                         spec.norm_topk_prob)
        self.gate = DeepseekRouter(hidden_size, spec)  # type: ignore[assignment]
        self.shared_experts = (GatedMLP(hidden_size, moe_intermediate_size * n_shared_experts)
                               if n_shared_experts > 0 else None)
        if self.shared_experts is not None:
            # Its partial sums join the experts' before the one all-reduce (or deferred sum).
            self.shared_experts.defer_reduction()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        # The experts take the weights in the activation dtype (fp32 routing, rounded once).
        out = self.experts_fn(x, self.w13, self.w2, ids, weights.to(x.dtype),
                              w13_scale=self.w13_scale, w2_scale=self.w2_scale)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return all_reduce(out) if self.reduce_output else out
