"""Host -> device copies of the sampling state's small tensors."""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without a hidden sync: a pageable upload may wait for the stream, so on
    CUDA the copy goes from pinned memory, asynchronously."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
