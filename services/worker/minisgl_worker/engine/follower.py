"""A TP rank other than 0: `python -m minisgl_worker.engine.follower CONFIG_JSON LOG_LEVEL`
(spawned by rank 0's TPGroup), or `python -m minisgl_worker --tp-rank K --dist-init-method ...`
(started by hand). It joins the group, builds its ModelRunner and loops: receive a plan
broadcast by rank 0, queue it, wait for the step before it, repeat; a `None` plan means shut down.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import signal
import sys

from minisgl_core.gc_pause import freeze_startup_objects, thaw

from .. import distributed as dist
from ..config import EngineConfig
from ..distributed.tp_group import TPGroup
from .runner import InFlight, ModelRunner
from .startup import prepare_rank

log = logging.getLogger(__name__)


def follower_main(config: EngineConfig, log_level: int = logging.INFO) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s tp{config.tp_rank} %(name)s "
                                                "%(levelname)s %(message)s")
    config, device = prepare_rank(config)
    TPGroup.join(config, device)
    runner = ModelRunner(config, device)
    freeze_startup_objects()  # as rank 0's ServiceHost does: a pause here stalls every rank
    # The step launched before the current one. This rank waits for a step only after queueing
    # the next, as rank 0 does (overlap): waiting right after each launch left its GPU idle
    # while it received and uploaded the next plan, and rank 0's first all-reduce of that step
    # waited for it (at batch 1, a large share of a step).
    pending: InFlight | None = None
    try:
        while True:
            plan = dist.broadcast_object(None)
            if plan is None:
                break
            try:
                if isinstance(plan, tuple):  # ("logits", plan): Engine.forward_logits
                    runner.run_logits(plan[1])
                    continue
                f = runner.run_step(plan)
                if pending is not None and pending.done is not None:
                    pending.done.synchronize()
                pending = f
            except Exception:  # rank 0 fails the step too; keep serving the next plans
                log.exception("rank %d: step %s failed", config.tp_rank, plan.step_id)
    finally:
        runner.release()  # its CUDA graphs first: NCCL will not abort a communicator they captured
        dist.destroy_tp()
        thaw()


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where is it stuck
    follower_main(EngineConfig(**json.loads(sys.argv[1])), int(sys.argv[2]))
