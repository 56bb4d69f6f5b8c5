"""vLLM's OpenAI server under bench.serving's load: the same requests (bench.serving.build_workload),
the same warm-up and the same HTTP client (bench.serving.run_load over
bench.common.stream_clients.http_request), 256 streams: tok/s, TTFT and ITL percentiles, and the
prefix-cache hit rate from vLLM's /metrics.

    python -m bench.peer.serving --model /tmp/q06 [--tp 2] \
        [--workload random|generated-shared-prefix] [--json FILE]
    # ours, same client and requests:
    python -m bench.serving --launch --model /tmp/q06 [--workload generated-shared-prefix]

`--workload offline` is `random` (the offline workload's requests).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from bench.common.prefix_cache import counters, hit_rate
from bench.peer.engine import add_engine_args, base_record, engine_kwargs
from bench.peer.server import Server
from bench.peer.vllm_env import add_common_args, check_site, emit, site_version
from bench.serving import build_workload, model_vocab, run_load, warm_up_stack

WORKLOADS = {"random": "random", "offline": "random", "shared-prefix": "shared-prefix",
             "generated-shared-prefix": "generated-shared-prefix"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p)
    add_common_args(p)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="random")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--request-rate", type=float, default=0.0, help="req/s (Poisson); 0 = all")
    p.add_argument("--client-procs", type=int, default=1)
    p.add_argument("--http-client", choices=["lean", "httpx"], default="lean")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--server-log", default="/tmp/minisgl-bench-logs/vllm-server.log")
    args = p.parse_args(argv)
    args.workload = WORKLOADS[args.workload]
    args.protocol = "http"  # run_load's settings for its HTTP path
    args.grpc_channels = 1
    return args


def make_server(args: argparse.Namespace, site: Path) -> Server:
    if not args.port:
        from minisgl_core.ports import free_port

        args.port = free_port()
    return Server.for_site(site, engine_kwargs(args, args.max_model_len), args.port,
                           Path(args.server_log))


def main() -> int:
    args = parse_args()
    site = check_site(args.vllm_site)
    workload = build_workload(args.workload, args.num_requests, vocab=model_vocab(args.model))
    server = make_server(args, site).start(args.startup_timeout)
    try:
        asyncio.run(warm_up_stack(args, server.url, ""))
        before = counters(f"{server.url}/metrics", "vllm")
        result = asyncio.run(run_load(args, workload, server.url, ""))
        after = counters(f"{server.url}/metrics", "vllm")
    finally:
        server.stop()
    result.pop("samples")
    emit({**base_record(site_version(site), args, "serving", server.env), **result,
          "hit_rate": hit_rate(before, after)}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
