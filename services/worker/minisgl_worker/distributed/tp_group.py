"""The processes of a tensor-parallel worker, as rank 0 sees them.

Rank 0 is the `Engine` the scheduler drives. Unless `dist_init_method` is given (ranks started by
hand, e.g. on several hosts), `TPGroup.start` starts ranks 1..N-1 on this host as fresh
interpreters running the module rank 0 names (`python -m MODULE CONFIG_JSON LOG_LEVEL`: unlike
multiprocessing's spawn, this never re-imports the caller's main script), then joins the group.
This module knows nothing of what the ranks run: the engine passes its follower module's name.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, replace

import torch
from minisgl_core.ports import free_port

from ..config import EngineConfig
from . import process_group as dist

log = logging.getLogger(__name__)


@dataclass
class TPGroup:
    procs: list[subprocess.Popen]  # the ranks this one spawned (none when started by hand)

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device, follower_module: str) -> TPGroup:
        """Rank 0: with no rendezvous given, spawn the other ranks first; then join the group."""
        if config.tp_rank != 0:
            raise ValueError("TPGroup.start is rank 0's; other ranks call TPGroup.join")
        init = config.dist_init_method
        procs: list[subprocess.Popen] = []
        if init is None:
            init = f"tcp://127.0.0.1:{free_port()}"
            # All ranks on this host: bootstrap gloo and NCCL over loopback. Left to themselves
            # they use the hostname's interface, which in a sandbox may not route at all. Set
            # for the spawned ranks (they inherit the environment) and for this one.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
            for rank in range(1, config.tp_size):
                cfg = replace(config, tp_rank=rank, dist_init_method=init, device=str(device.type))
                cmd = [sys.executable, "-m", follower_module,
                       json.dumps(dataclasses.asdict(cfg)), str(logging.getLogger().level)]
                procs.append(subprocess.Popen(cmd))
        dist.init_tp(0, config.tp_size, init, device)
        return cls(procs)

    @staticmethod
    def join(config: EngineConfig, device: torch.device) -> None:
        """A rank > 0: join rank 0's rendezvous."""
        if config.dist_init_method is None:
            raise ValueError("tp_rank > 0 needs dist_init_method (rank 0's rendezvous)")
        dist.init_tp(config.tp_rank, config.tp_size, config.dist_init_method, device)

    def stop(self, timeout: float = 30.0) -> None:
        """Tell the other ranks to leave (a None plan), wait for the spawned ones, then leave."""
        try:
            dist.broadcast_object(None)
        except Exception:  # a follower died: the group is broken, just reap the processes
            log.exception("could not signal the TP ranks to stop")
        # The followers leave the group on the None plan (their teardown is local, it waits for
        # no peer) and exit; this rank leaves only then, because it hosts the group's TCP store:
        # closing it first made each follower's NCCL heartbeat thread print a "recvValue failed"
        # stack trace at shutdown (H200 pair).
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.terminate()
                p.wait(5.0)
        dist.destroy_tp()
