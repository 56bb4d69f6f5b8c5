"""The one-shot CUDA IPC all-reduce (kernels/all_reduce.py) against exact sums on 2 GPUs: eager
calls of odd sizes in bf16 and fp32 with grids that change call to call, and CUDA graph replays
(bench/micro/all_reduce.py does the checking, then times it against NCCL)."""

from __future__ import annotations

import pytest
import torch

from bench.micro import all_reduce


def test_one_shot_all_reduce_sums_exactly() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert all_reduce.main(["--world", "2", "--ops", "5"]) == 0
