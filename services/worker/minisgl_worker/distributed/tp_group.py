"""The processes of a tensor-parallel worker.

Rank 0 is the `Engine` the scheduler drives. Unless `dist_init_method` is given (ranks started by
hand, e.g. on several hosts), rank 0 starts ranks 1..N-1 on this host as fresh interpreters
(`python -m minisgl_worker.distributed.tp_group CONFIG_JSON`: unlike multiprocessing's spawn, this never
re-imports the caller's main script). Those build the same Engine for their rank and loop:
receive a plan broadcast by rank 0, run it, wait for it, repeat; a `None` plan means shut down.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, replace

import torch
from minisgl_core.gc_pause import freeze_startup_objects, thaw

from ..config import EngineConfig
from . import process_group as dist

log = logging.getLogger(__name__)


@dataclass
class Followers:
    procs: list[subprocess.Popen]


def init_rank(config: EngineConfig, device: torch.device) -> Followers | None:
    """Join the TP group; on rank 0 with no rendezvous given, spawn the other ranks first."""
    followers = Followers([]) if config.tp_rank == 0 else None
    init = config.dist_init_method
    if init is None:
        if config.tp_rank != 0:
            raise ValueError("tp_rank > 0 needs dist_init_method (rank 0's rendezvous)")
        init = f"tcp://127.0.0.1:{dist.free_port()}"
        # All ranks on this host: bootstrap gloo and NCCL over loopback. Left to themselves they
        # use the hostname's interface, which in a sandbox may not route at all.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        procs: list[subprocess.Popen] = []
        for rank in range(1, config.tp_size):
            cfg = replace(config, tp_rank=rank, dist_init_method=init, device=str(device.type))
            cmd = [sys.executable, "-m", "minisgl_worker.distributed.tp_group",
                   json.dumps(dataclasses.asdict(cfg)), str(logging.getLogger().level)]
            procs.append(subprocess.Popen(cmd))
        followers = Followers(procs)
    dist.init_tp(config.tp_rank, config.tp_size, init, device)
    return followers


def follower_main(config: EngineConfig, log_level: int = logging.INFO) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s tp{config.tp_rank} %(name)s "
                                                "%(levelname)s %(message)s")
    from ..engine import Engine

    engine = Engine(config)
    freeze_startup_objects()  # as rank 0's ServiceHost does: a pause here stalls every rank
    try:
        while True:
            plan = dist.broadcast_object(None)
            if plan is None:
                break
            try:
                if isinstance(plan, tuple):  # ("logits", plan): Engine.forward_logits
                    engine.run_logits(plan[1])
                    continue
                f = engine.run_step(plan)
                if f.done is not None:
                    f.done.synchronize()
            except Exception:  # rank 0 fails the step too; keep serving the next plans
                log.exception("rank %d: step %s failed", config.tp_rank, plan.step_id)
    finally:
        engine.close()  # its CUDA graphs first: NCCL will not abort a communicator they captured
        dist.destroy_tp()
        thaw()


def stop_followers(followers: Followers, timeout: float = 30.0) -> None:
    try:
        dist.broadcast_object(None)
    except Exception:  # a follower died: the group is broken, just reap the processes
        log.exception("could not signal the TP ranks to stop")
    # The followers leave the group on the None plan (their teardown is local, it waits for
    # no peer) and exit; this rank leaves only then, because it hosts the group's TCP store:
    # closing it first made each follower's NCCL heartbeat thread print a "recvValue failed"
    # stack trace at shutdown (H200 pair).
    for p in followers.procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.terminate()
            p.wait(5.0)
    dist.destroy_tp()


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where is it stuck
    follower_main(EngineConfig(**json.loads(sys.argv[1])), int(sys.argv[2]))
