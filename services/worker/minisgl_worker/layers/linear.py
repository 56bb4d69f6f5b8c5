"""Linear layers split for tensor parallelism (Megatron style).

ColumnParallelLinear splits output features: each rank holds its rows of every packed sub-matrix
(q|k|v or gate|up), so no communication is needed after it. RowParallelLinear splits input
features and all-reduces the partial sums; its bias is added once, after the reduction (or, when
the reduction is deferred to the next norm, by rank 0 alone).
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import all_reduce, shard, tp
from ..fp8 import Fp8Rows
from ..kernels import fused_ops
from .fp8_linear import Fp8Linear
from .weights import WeightSource, check_shape, default_loader, new_param, read, set_loader, src_shape


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = set_loader(new_param(out_features, in_features), default_loader)
        self.bias = set_loader(new_param(out_features), default_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.linear(x, self.weight, self.bias)


class ReplicatedProjection(Fp8Linear):
    """A projection every rank holds whole (DeepSeek's latent q_a_proj, kv_a_proj_with_mqa),
    which a pre-quantized checkpoint may store in fp8 (quant_load/fp8_mla.py). Routers stay
    ReplicatedLinear: their logits pick the experts, never quantized; --quantization fp8
    leaves this class as loaded too."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = set_loader(new_param(out_features, in_features), default_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class ColumnParallelLinear(Fp8Linear):
    """out = x @ [W_0; W_1; ...]^T with each W_i (full size out_sizes[i]) split by rank.
    Checkpoint tensors load one at a time with shard_id = i (0 when there is a single one)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.full_sizes = list(out_sizes)
        self.local_sizes = [shard(n, "output features") for n in out_sizes]
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(out_sizes))]
        out_local = sum(self.local_sizes)
        n = len(out_sizes)
        self.weight = set_loader(new_param(out_local, in_features), self._load, n)
        self.bias = set_loader(new_param(out_local), self._load, n) if bias else None

    def _load(self, param: nn.Parameter, src: WeightSource, shard_id: int | None = None) -> None:
        i = shard_id or 0
        want = (self.full_sizes[i], *param.shape[1:])
        check_shape(f"packed part {i}", src_shape(src), want)
        n = self.local_sizes[i]
        param.data.narrow(0, self.offsets[i], n).copy_(read(src, 0, tp().rank * n, n))

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return self.matmul(x, self.bias)


class RowParallelLinear(Fp8Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_local = shard(in_features, "input features")
        self.in_features = in_features
        self.weight = set_loader(new_param(out_features, self.in_local), self._load)
        self.bias = set_loader(new_param(out_features), default_loader) if bias else None
        self.reduce_output = True  # False: defer_reduction
        self.add_bias = True  # False on ranks > 0 once deferred: the bias enters the sum once

    def _load(self, param: nn.Parameter, src: WeightSource, shard_id: object = None) -> None:
        check_shape("a row-parallel weight", src_shape(src), (param.shape[0], self.in_features))
        n = self.in_local
        param.data.copy_(read(src, 1, tp().rank * n, n))

    def forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """With silu_mul x is [gate | up] rows and the input is silu(gate) * up, computed inside
        the product: the one-row GEMV, or an fp8 layer's activation quantization (the caller,
        GatedMLP, checks `folds_silu_mul`)."""
        out = self.matmul(x, silu_mul=silu_mul)
        if self.reduce_output:
            out = all_reduce(out)
        return out + self.bias if self.bias is not None and self.add_bias else out

    def defer_reduction(self) -> None:
        """Hand out this rank's partial sums: the consumer (the next norm, RMSNorm.add_forward
        with reduce=True) sums them over the ranks, fused with its own work. A bias (gpt-oss's
        o_proj) is then added to rank 0's partial sums only."""
        self.reduce_output = False
        self.add_bias = tp().rank == 0

    def folds_silu_mul(self, gate_up: torch.Tensor) -> bool:
        return self.weight_scale is not None or fused_ops.gemv_usable(gate_up)
