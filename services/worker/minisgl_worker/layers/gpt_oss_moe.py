"""gpt-oss's sparse MoE block: the stacked experts of `SparseMoeBlock` plus what gpt-oss adds.

- The router has a bias, and picks the top-k router *logits* first, then softmaxes over those k
  (HF `GptOssTopKRouter`; the same weights as a softmax over all experts renormalised over the
  top k, computed as HF does).
- Every expert has biases on gate/up and on down, and the clamped SwiGLU activation
  (kernels/clamped_swiglu.py); the experts function takes them as keyword arguments (both the
  Triton kernels and the torch reference compute them).
- Checkpoints store the experts stacked, as transformers saves `GptOssExperts`:
  gate_up_proj [E, H, 2I] with gate and up *interleaved* along the last dim (gate = [..., 0::2]),
  gate_up_proj_bias [E, 2I] (interleaved too), down_proj [E, I, H], down_proj_bias [E, H].
  They load transposed and de-interleaved into w13 [E, 2 * I_local, H] (gate rows, then up
  rows), w13_bias [E, 2 * I_local], w2 [E, H, I_local], w2_bias [E, H].

TP splits each expert's intermediate dimension like Qwen3-MoE's: rank r takes intermediate
columns r*n .. (r+1)*n of gate and of up (interleaved positions 2rn .. 2(r+1)n, one contiguous
read) and the same rows of down. The experts' outputs are partial sums over the ranks, so the
down bias is loaded on rank 0 only (zeros elsewhere): it enters the sum once.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import all_reduce, tp
from ..kernels import moe_mxfp4
from ..kernels.clamped_swiglu import ClampedSwiGLU
from ..kernels.fused_moe import fused_moe, warm_up
from .linear import ReplicatedLinear
from .moe import SparseMoeBlock
from .weights import WeightSource, check_shape, new_param, read, set_loader, src_shape


class GptOssMoeBlock(SparseMoeBlock):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 activation: ClampedSwiGLU) -> None:
        super().__init__(hidden_size, intermediate_size, num_experts, top_k, norm_topk_prob=True)
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=True)  # HF mlp.router
        self.activation = activation
        n = self.inter_local
        # One checkpoint tensor each (all experts stacked), unlike Qwen3-MoE's per-expert ones.
        set_loader(self.w13, self._load_gate_up)
        set_loader(self.w2, self._load_down)
        self.w13_bias = set_loader(new_param(num_experts, 2 * n), self._load_gate_up_bias)
        self.w2_bias = set_loader(new_param(num_experts, hidden_size), self._load_down_bias)

    def release_experts(self) -> None:
        """MXFP4 checkpoints: w13 / w2 become shapes on the meta device (no memory) until
        quant_load/mxfp4.py installs the packed parameters (or bf16 ones again for a layer the
        checkpoint stores unquantized), so a bf16 copy of every expert is never allocated."""
        for name in ("w13", "w2"):
            old = getattr(self, name)
            meta = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device="meta"),
                                requires_grad=False)
            setattr(self, name, set_loader(meta, old.weight_loader, old.num_shards))

    # -- loading ---------------------------------------------------------------------------------

    def _split_gate_up(self, part: torch.Tensor, param: torch.Tensor) -> None:
        """part [..., 2n] with gate and up interleaved -> param[:, :n] = gate, param[:, n:] = up,
        both along dim 1 (param [E, 2n(, H)])."""
        n = self.inter_local
        param.narrow(1, 0, n).copy_(part[..., 0::2].transpose(1, -1))
        param.narrow(1, n, n).copy_(part[..., 1::2].transpose(1, -1))

    def _load_gate_up(self, param: nn.Parameter, src: WeightSource, shard_id: object) -> None:
        e, h, i = self.num_experts, self.hidden_size, self.inter
        check_shape("mlp.experts.gate_up_proj", src_shape(src), (e, h, 2 * i))
        n = self.inter_local
        self._split_gate_up(read(src, 2, 2 * tp().rank * n, 2 * n), param.data)  # [E, H, 2n]

    def _load_gate_up_bias(self, param: nn.Parameter, src: WeightSource,
                           shard_id: object) -> None:
        check_shape("mlp.experts.gate_up_proj_bias", src_shape(src),
                    (self.num_experts, 2 * self.inter))
        n = self.inter_local
        self._split_gate_up(read(src, 1, 2 * tp().rank * n, 2 * n), param.data)  # [E, 2n]

    def _load_down(self, param: nn.Parameter, src: WeightSource, shard_id: object) -> None:
        check_shape("mlp.experts.down_proj", src_shape(src),
                    (self.num_experts, self.inter, self.hidden_size))
        n = self.inter_local
        param.data.copy_(read(src, 1, tp().rank * n, n).transpose(1, 2))  # [E, n, H] -> [E, H, n]

    def _load_down_bias(self, param: nn.Parameter, src: WeightSource, shard_id: object) -> None:
        check_shape("mlp.experts.down_proj_bias", src_shape(src),
                    (self.num_experts, self.hidden_size))
        if tp().rank == 0:
            param.data.copy_(read(src))
        else:  # the other ranks' partial sums must not add it again
            param.data.zero_()

    # -- compute ---------------------------------------------------------------------------------

    def _experts_options(self) -> dict[str, object]:
        return dict(w13_bias=self.w13_bias, w2_bias=self.w2_bias, activation=self.activation)

    def route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, K] in the logits' dtype, ids [T, K]): the top-k logits, softmaxed."""
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=torch.float32).to(logits.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route_logits(self.gate(x))
        out = self.experts_fn(x, self.w13, self.w2, ids, weights, w13_scale=self.w13_scale,
                              w2_scale=self.w2_scale, **self._experts_options())
        return all_reduce(out) if self.reduce_output else out

    def warm_up_kernels(self, dtype: torch.dtype) -> list[int]:
        """As SparseMoeBlock's, for the kernel variants with biases and the clamped SwiGLU."""
        if self.experts_fn is moe_mxfp4.mxfp4_moe:  # packed MXFP4 experts (quant_load/mxfp4.py)
            assert isinstance(self.w13_scale, torch.Tensor)
            assert isinstance(self.w2_scale, torch.Tensor)
            return moe_mxfp4.warm_up(self.w13, self.w2, self.w13_scale, self.w2_scale,
                                     self.top_k, dtype, **self._experts_options())  # type: ignore[arg-type]
        if self.experts_fn is not fused_moe:
            return []
        w13_scale, w2_scale = self.w13_scale, self.w2_scale
        assert not isinstance(w13_scale, nn.Module) and not isinstance(w2_scale, nn.Module)
        return warm_up(self.w13, self.w2, self.top_k, dtype, w13_scale=w13_scale,
                       w2_scale=w2_scale, w13_bias=self.w13_bias, w2_bias=self.w2_bias,
                       activation=self.activation)
