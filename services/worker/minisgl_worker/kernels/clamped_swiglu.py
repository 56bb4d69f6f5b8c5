"""gpt-oss's expert activation, a SwiGLU with clamped inputs and a shifted up branch:

    gate = min(gate, limit)      up = clamp(up, -limit, limit)
    act  = (up + 1) * gate * sigmoid(alpha * gate)

(HF `GptOssExperts._apply_gate`; config `swiglu_limit`, `swiglu_alpha`). The experts functions
take it as `activation=`; None is Qwen3-MoE's plain silu(gate) * up. The Triton gate/up kernel
computes the same formula in its epilogue (fused_moe_kernels.gate_up_kernel, CLAMPED).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ClampedSwiGLU:
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
