"""The Qwen3-MoE sparse block: softmax router, top-k experts, optional renormalisation.

Experts are stored stacked, in the layout `fused_moe` takes:
    w13 [E, 2 * I_local, H]  (gate rows, then up rows)    w2 [E, H, I_local]
TP splits each expert's intermediate dimension (I_local = I / tp), like a dense MLP, and the
partial outputs are all-reduced. The expert computation goes through `self.experts_fn`
(default `fused_moe.fused_moe`: grouped Triton GEMMs on CUDA, a per-expert torch loop on CPU);
assign another function with the same signature to plug in a different kernel. `--quantization
fp8` turns the experts into fp8 rows with one scale each (`quantize_fp8`); the router stays as
loaded, since its logits pick the experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..distributed import all_reduce, shard, tp
from ..kernels.fused_moe import fused_moe, quantize_experts, route, warm_up
from .linear import ReplicatedLinear
from .weights import WeightSource, check_shape, new_param, read, set_loader, src_shape

# (hidden, w13, w2, topk_ids, topk_weights, *, w13_scale, w2_scale) -> [T, H]; scales are None
# unless the experts are fp8
ExpertsFn = Callable[..., torch.Tensor]


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.hidden_size, self.inter = hidden_size, intermediate_size
        self.inter_local = shard(intermediate_size, "moe_intermediate_size")
        self.gate = ReplicatedLinear(hidden_size, num_experts)  # the router
        self.w13 = set_loader(new_param(num_experts, 2 * self.inter_local, hidden_size),
                              self._load_w13, 2 * num_experts)
        self.w2 = set_loader(new_param(num_experts, hidden_size, self.inter_local), self._load_w2,
                             num_experts)
        self.register_buffer("w13_scale", None)  # [E, 2 * I_local] fp32 once quantized
        self.register_buffer("w2_scale", None)  # [E, H]
        self.experts_fn: ExpertsFn = fused_moe
        self.reduce_output = True  # False: defer_reduction

    def _load_w13(self, param: nn.Parameter, src: WeightSource, shard_id: tuple[int, int]) -> None:
        """shard_id = (expert, 0 for gate_proj | 1 for up_proj); src [I, H]."""
        expert, which = shard_id
        check_shape("an expert gate/up_proj", src_shape(src), (self.inter, self.hidden_size))
        n = self.inter_local
        param.data[expert].narrow(0, which * n, n).copy_(read(src, 0, tp().rank * n, n))

    def _load_w2(self, param: nn.Parameter, src: WeightSource, shard_id: tuple[int, int]) -> None:
        """shard_id = (expert, 0); src down_proj [H, I]."""
        check_shape("an expert down_proj", src_shape(src), (self.hidden_size, self.inter))
        n = self.inter_local
        param.data[shard_id[0]].copy_(read(src, 1, tp().rank * n, n))

    def quantize_fp8(self) -> None:
        """Replace the loaded experts by fp8 rows and their scales (frees the originals)."""
        for name in ("w13", "w2"):
            q, scale = quantize_experts(getattr(self, name).data)
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            setattr(self, f"{name}_scale", scale)

    def warm_up_kernels(self, dtype: torch.dtype) -> list[int]:
        """Compile the default experts kernels' every tile config now (CUDA only): the token
        counts run, [] when nothing was compiled here."""
        w13_scale, w2_scale = self.w13_scale, self.w2_scale  # buffers: None or fp32 tensors
        assert not isinstance(w13_scale, nn.Module) and not isinstance(w2_scale, nn.Module)
        if self.experts_fn is not fused_moe:  # another kernel may warm itself up
            own = getattr(self.experts_fn, "warm_up", None)
            return own(self.w13, self.w2, self.top_k, dtype, w13_scale=w13_scale,
                       w2_scale=w2_scale) if own is not None else []
        return warm_up(self.w13, self.w2, self.top_k, dtype,
                       w13_scale=w13_scale, w2_scale=w2_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.norm_topk_prob)
        out = self.experts_fn(x, self.w13, self.w2, ids, weights,
                              w13_scale=self.w13_scale, w2_scale=self.w2_scale)
        return all_reduce(out) if self.reduce_output else out

    def defer_reduction(self) -> None:
        """As RowParallelLinear.defer_reduction: the next norm sums the experts' partial sums."""
        self.reduce_output = False
