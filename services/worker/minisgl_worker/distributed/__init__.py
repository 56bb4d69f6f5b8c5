"""Tensor parallelism: the process group and its collectives (process_group.py, what the layers
use) and the TP rank processes of one host (tp_group.py)."""

from .process_group import (
    TPState,
    all_gather_last,
    all_gather_stack,
    all_reduce,
    broadcast_object,
    destroy_tp,
    init_tp,
    shard,
    tp,
    use_fast_all_reduce,
)

__all__ = ["TPState", "all_gather_last", "all_gather_stack", "all_reduce", "broadcast_object",
           "destroy_tp", "init_tp", "shard", "tp", "use_fast_all_reduce"]
