"""Device buffers every TP rank can read and write: each rank allocates one, and the others map it
into their address space over CUDA IPC (cudaIpcGetMemHandle / OpenMemHandle, through PyTorch's own
tensor sharing), so a kernel on any rank can load from and store to any rank's buffer directly over
NVLink. The custom all-reduce (kernels/all_reduce.py) is built on two such buffers.

Only for ranks on one host whose GPUs can all reach each other (peer access); `peer_access_ok`
says whether they can. The handles travel over the TP group's gloo group.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor


@dataclass
class PeerBuffers:
    local: torch.Tensor  # this rank's buffer
    addresses: list[int]  # every rank's buffer, as mapped in this process (rank order)
    ptrs: torch.Tensor  # the same addresses, int64 [world] on this rank's device
    mapped: list[torch.Tensor]  # the other ranks' buffers as mapped here (kept alive)


def peer_access_ok(world: int) -> bool:
    """Every pair of the first `world` GPUs can reach each other directly (this process's view)."""
    if torch.cuda.device_count() < world:
        return False
    return all(torch.cuda.can_device_access_peer(a, b)
               for a, b in itertools.permutations(range(world), 2))


def exchange(nbytes: int, rank: int, world: int, cpu_group: Any,
             device: torch.device, fill: int = 0) -> PeerBuffers:
    """Allocate `nbytes` on this rank, every byte `fill`, and map every other rank's buffer.
    Collective: every rank of `cpu_group` calls it with the same `nbytes`."""
    # A segment of its own (not a slice of a cached block another tensor shares), filled and
    # finished before any peer can write into it.
    local = torch.full((nbytes,), fill, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    handles: list[Any] = [None] * world
    dist.all_gather_object(handles, reduce_tensor(local), group=cpu_group)
    ptrs: list[int] = []
    mapped: list[torch.Tensor] = []
    for r, (rebuild, args) in enumerate(handles):
        if r == rank:
            ptrs.append(local.data_ptr())
            continue
        # Open the handle in this rank's device context (argument 6 is the device the owner
        # allocated on): opened under the owner's index it is mapped for that device's context
        # only, and a kernel on this GPU touching it faults. Under this one, with the lazy peer
        # access PyTorch asks for, this GPU reads and writes it over NVLink.
        args = (*args[:6], device.index, *args[7:])
        peer = rebuild(*args)
        mapped.append(peer)
        ptrs.append(peer.data_ptr())
    dist.barrier(group=cpu_group)  # every rank has mapped every buffer before any is used
    return PeerBuffers(local, ptrs, torch.tensor(ptrs, dtype=torch.int64, device=device), mapped)
