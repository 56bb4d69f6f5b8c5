"""`python -m minisgl_worker --model PATH`: the worker service (one GPU, or TP ranks on one host).

Every flag also reads MINISGL_WORKER_<FLAG> from the environment (flags win). EngineConfig fields
map 1:1 onto flags (`--page-size` -> page_size; `--model` -> model_path), declared in config.py.
With --tp-size N, rank 0 serves gRPC and spawns ranks 1..N-1; ranks started by hand (--tp-rank K
--dist-init-method tcp://HOST:PORT) only follow.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields
from typing import Any

from minisgl_core.flags import ServiceFlags
from minisgl_core.startup import begin

from .config import FLAGS, EngineConfig

log = logging.getLogger("minisgl_worker")


def build_parser() -> ServiceFlags:
    return FLAGS


def config_from_args(ns: Any) -> EngineConfig:
    values = {f.name: getattr(ns, f.name) for f in fields(EngineConfig)}
    if not values["model_path"]:
        raise SystemExit("minisgl-worker: --model (or MINISGL_WORKER_MODEL) is required")
    overrides = values["hf_overrides"]
    values["hf_overrides"] = json.loads(overrides) if isinstance(overrides, str) else overrides
    return EngineConfig(**values)


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse(argv)
    begin("worker", ns.log_level)
    config = config_from_args(ns)
    if config.tp_rank > 0:
        from .engine.follower import follower_main

        follower_main(config, logging.getLogger().level)
        return

    from minisgl_core.proto.minisgl.v1 import worker_pb2_grpc
    from minisgl_core.security import check_listener, from_args
    from minisgl_core.serving import ServiceHost

    from .engine import Engine
    from .server import WorkerService

    security = from_args(ns.internal_token_file, ns.internal_tls_dir)  # before the model loads
    check_listener("worker", ns.host, security, ns.insecure)
    engine = Engine(config)
    try:
        info = engine.info()
        log.info("serving %s: %d pages x %d tokens (%s), %d slots, context %d, %s on %s",
                 info.model_name, info.num_pages, info.page_size, info.kv_cache_dtype,
                 info.max_slots, info.max_model_len, info.attention_backend, info.device)
        service = WorkerService(engine)
        # Message limit: the default (64 MiB). One step may restart many requests, each with
        # up to a context of history_ids, so no per-prompt bound applies.
        host = ServiceHost("worker", ns.host, ns.port, metrics_port=ns.metrics_port or None,
                           security=security, metrics_host=ns.metrics_host or None,
                           reflection=ns.reflection)
        host.add(worker_pb2_grpc.add_WorkerServicer_to_server, service, "minisgl.v1.Worker")
        host.on_drain(service.drain)
        host.serve_forever(drain_timeout=ns.drain_timeout)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
