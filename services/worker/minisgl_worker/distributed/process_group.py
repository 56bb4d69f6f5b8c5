"""Tensor parallelism: the process group, the collectives the layers use, and plan broadcast.

One process per rank. Rank 0 is the one the scheduler talks to: it validates each StepPlan and
broadcasts it to the other ranks over a gloo group (plans are small Python objects), then every
rank runs the same forward. Model collectives (all-reduce after row-parallel layers, all-gather
of vocab-parallel logits) go over NCCL on GPU and gloo on CPU.
With tp_size == 1 every collective is a no-op and torch.distributed is never initialised.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# The one-tensor all-gather: torch 2.13 renamed all_gather_into_tensor (and warns on the old name).
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class FastAllReduce(Protocol):
    def supports(self, x: torch.Tensor, with_norm: bool = False) -> bool: ...
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...
    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> torch.Tensor: ...
    def warm_up(self, dtype: torch.dtype, hidden_size: int) -> None: ...


@dataclass
class TPState:
    rank: int = 0
    size: int = 1
    group: Any = None  # model collectives (NCCL on GPU, gloo on CPU)
    cpu_group: Any = None  # gloo: plan broadcast
    # A faster in-place all-reduce for the messages it `supports` (kernels/all_reduce.py's
    # one-shot over CUDA IPC), installed by the engine layer once the group exists.
    fast_all_reduce: FastAllReduce | None = None


_TP = TPState()


def tp() -> TPState:
    return _TP


def init_tp(rank: int, size: int, init_method: str, device: torch.device,
            timeout_s: float = 300.0) -> TPState:
    global _TP
    if size == 1:
        _TP = TPState()
        return _TP
    backend = "nccl" if device.type == "cuda" else "gloo"
    # The timeout bounds the rendezvous (a rank that died at start-up) and every collective.
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    # Plans go over their own gloo group whose timeout is "never": followers wait on it while the
    # worker is idle, however long that is.
    cpu_group = dist.new_group(backend="gloo", timeout=timedelta(days=365))
    _TP = TPState(rank, size, dist.group.WORLD, cpu_group)
    return _TP


def destroy_tp(timeout_s: float = 30.0) -> None:
    """Leave the TP group. Every rank calls this at shutdown, after its last collective and
    after its CUDA graphs are destroyed (Engine.close): NCCL holds a communicator alive for every
    graph that captured one of its collectives, and with graphs still alive both destroy and
    abort sat in NCCL on the H200 pair until the abandoned thread took the interpreter down at
    exit ("terminate called without an active exception"). With the graphs gone, abort takes
    0.3-0.8 s. NCCL is aborted rather than destroyed: abort is local and does not wait for the
    peer; nothing is in flight any more, so nothing is lost. A teardown that still does not
    finish in time is abandoned with a warning rather than hanging the caller."""
    global _TP
    state, _TP = _TP, TPState()
    if state.size == 1 or not dist.is_initialized():
        return

    def teardown() -> None:
        t0 = time.perf_counter()

        def done(phase: str) -> None:
            log.debug("tp teardown rank %d: %s after %.3fs", state.rank, phase,
                      time.perf_counter() - t0)

        if torch.cuda.is_available() and dist.get_backend(state.group) == "nccl":
            torch.cuda.synchronize()
            done("synchronize")
            dist.destroy_process_group(state.cpu_group)  # gloo: closes its sockets
            done("gloo destroyed")
            dist.distributed_c10d._abort_process_group()
            done("nccl aborted")
        else:
            dist.destroy_process_group()
            done("destroyed")

    t = threading.Thread(target=teardown, name="tp-destroy", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.warning("torch.distributed teardown did not finish in %.0fs; abandoned", timeout_s)


def shard(n: int, what: str) -> int:
    """This rank's share of a dimension that TP splits evenly."""
    size = _TP.size
    if n % size:
        raise ValueError(f"{what}={n} is not divisible by tp_size={size}")
    return n // size


def use_fast_all_reduce(fast: FastAllReduce | None) -> None:
    """Route the all-reduces `fast` supports through it (None: NCCL/gloo for all)."""
    _TP.fast_all_reduce = fast


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the TP ranks, in place (returns x)."""
    if _TP.size > 1:
        fast = _TP.fast_all_reduce
        if fast is not None and fast.supports(x):
            return fast(x)
        dist.all_reduce(x, group=_TP.group)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's x along the last dim, in rank order."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=-1)


def all_gather_stack(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x stacked in rank order, [size, *x.shape] (small messages: one collective
    into one tensor, no list and no cat)."""
    if _TP.size == 1:
        return x[None]
    # Flat along dim 0: gloo insists on an output of [size * x.shape[0], ...].
    out = torch.empty((_TP.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _gather_single(out, x.contiguous(), group=_TP.group)
    return out.view(_TP.size, *x.shape)


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (others pass anything)."""
    if _TP.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_TP.cpu_group)
    return box[0]
