"""`python -m minisgl_scheduler --worker HOST:PORT`: the scheduler service.

Every flag also reads MINISGL_SCHEDULER_<FLAG> from the environment (flags win).
"""

from __future__ import annotations

import logging
import sys
import threading

from minisgl_core.flags import ServiceFlags
from minisgl_core.proto.minisgl.v1 import scheduler_pb2_grpc
from minisgl_core.security import check_listener, from_args
from minisgl_core.serving import ServiceHost
from minisgl_core.startup import begin, report_failure

from minisgl_scheduler.config import FLAGS, SchedulerConfig
from minisgl_scheduler.errors import WorkerFailed
from minisgl_scheduler.metrics import SchedulerMetrics
from minisgl_scheduler.pending import PendingScheduler
from minisgl_scheduler.scheduler import Scheduler
from minisgl_scheduler.server import SchedulerService
from minisgl_scheduler.worker_client import WorkerClient

log = logging.getLogger("minisgl_scheduler")


def build_parser() -> ServiceFlags:
    return FLAGS


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse(argv)
    begin("scheduler", ns.log_level)
    # Also the default of the worker client's channel: the token and certificate go with it.
    security = from_args(ns.internal_token_file, ns.internal_tls_dir)
    check_listener("scheduler", ns.host, security, ns.insecure)
    config = FLAGS.build(SchedulerConfig, ns)
    config.validate()
    metrics = SchedulerMetrics.get() if ns.metrics_port else None
    pending = PendingScheduler(ns.worker)
    # Message limit: the default (64 MiB). A ConnectRequest coalesces the submits of every request
    # the gateway admitted meanwhile (hundreds of prompts), so no per-prompt bound applies.
    host = ServiceHost("scheduler", ns.host, ns.port, metrics_port=ns.metrics_port or None,
                       security=security, metrics_host=ns.metrics_host or None,
                       reflection=ns.reflection)
    host.add(scheduler_pb2_grpc.add_SchedulerServicer_to_server, pending, "minisgl.v1.Scheduler")
    host.on_drain(pending.drain)

    def connect(stop: threading.Event) -> bool:
        """Listening with health NOT_SERVING: wait for the worker, then serve."""
        log.info("waiting for the worker at %s", ns.worker)
        try:
            client = WorkerClient(ns.worker, connect_timeout=ns.worker_timeout,
                                  step_timeout=ns.step_timeout, stop=stop)
        except WorkerFailed:
            if stop.is_set():
                return False
            raise
        scheduler = Scheduler(client, config)
        info = scheduler.info
        log.info("worker %s: model %s, %d pages x %d tokens (%s), %d slots, context %d",
                 ns.worker, info.model_name, info.num_pages, info.page_size,
                 info.kv_cache_dtype or "?", info.max_slots, info.max_model_len)
        pending.attach(SchedulerService(scheduler, metrics).start())
        return True

    try:
        host.serve_forever(drain_timeout=ns.drain_timeout, prepare=connect)
    except WorkerFailed as exc:
        report_failure(exc, "scheduler")
        sys.exit(1)

if __name__ == "__main__":
    main()
