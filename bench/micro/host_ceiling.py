"""The services' host-side ceiling: the real stack with a worker that computes nothing.

    python -m bench.micro.host_ceiling --model DIR [--step-ms 0] [--concurrency 256] [--protocol http]

The worker process serves the real `WorkerService` over an engine that answers each step at once
(or after `--step-ms`), sampling token (rid * 7 + step) % vocab. Everything else is the real
gateway, tokenizer, scheduler and detokenizer, driven by bench.serving's load. The output
tok/s is what the services can carry at most on this host: if it is not well above the GPU's
in-process rate, the stack cannot reach it either. Run it under py-spy to see where time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import deque
from pathlib import Path


def serve_null_worker(args: argparse.Namespace) -> None:
    from minisgl_core.proto.minisgl.v1 import worker_pb2_grpc
    from minisgl_core.serving import ServiceHost
    from minisgl_core.step import StepExecutor, StepOutput, StepPlan, WorkerInfo
    from minisgl_worker.server import WorkerService

    cfg = json.loads((Path(args.model) / "config.json").read_text())

    class NullEngine(StepExecutor):
        def __init__(self) -> None:
            self._queue: deque[StepPlan] = deque()

        def info(self) -> WorkerInfo:
            return WorkerInfo(model_name=Path(args.model).name, num_pages=1 << 16, page_size=16,
                              max_model_len=4096, max_slots=256, vocab_size=cfg["vocab_size"],
                              eos_token_ids=[], device="null")

        def launch(self, plan: StepPlan) -> None:
            self._queue.append(plan)

        def collect(self) -> StepOutput:
            plan = self._queue.popleft()
            if args.step_ms:
                time.sleep(args.step_ms / 1e3)
            rids = plan.decodes.rids + [r.rid for r in plan.reqs if r.sample]
            vocab = cfg["vocab_size"]
            return StepOutput(plan.step_id, rids, [(rid * 7 + plan.step_id) % vocab
                                                   for rid in rids])

    host = ServiceHost("worker", "127.0.0.1", args.port, metrics_port=None)
    host.add(worker_pb2_grpc.add_WorkerServicer_to_server, WorkerService(NullEngine()),
             "minisgl.v1.Worker")
    host.serve_forever(drain_timeout=1.0)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a dir with config.json + tokenizer files")
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--protocol", choices=["http", "grpc"], default="http")
    ap.add_argument("--gateway-replicas", type=int, default=1)
    ap.add_argument("--grpc-channels", type=int, default=8)
    ap.add_argument("--client-procs", type=int, default=1)
    ap.add_argument("--internal-auth", choices=["none", "token", "mtls"], default="token",
                    help="internal RPCs open, with the per-run token, or token over mTLS")
    ap.add_argument("--serve-worker-port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_worker_port:
        args.port = args.serve_worker_port
        serve_null_worker(args)
        return 0

    from minisgl.launcher import Stack, StackConfig
    from minisgl_core.ports import free_port

    from bench.common.certs import make_certs
    from bench.serving import build_workload, run_load

    class NullWorkerStack(Stack):
        def _command(self, name: str) -> list[str]:
            if name != "worker":
                return super()._command(name)
            return [sys.executable, "-m", "bench.micro.host_ceiling", "--model", args.model, "--step-ms",
                    str(args.step_ms), "--serve-worker-port", str(self.ports["worker"])]

    stack = NullWorkerStack(StackConfig(
        model_path=args.model, http_port=free_port(), grpc_port=free_port(),
        internal_ports=dict.fromkeys(("worker", "tokenizer", "detokenizer", "scheduler"), 0),
        log_dir=Path("/tmp/minisgl-ceiling-logs"),
        log_level=os.environ.get("CEILING_LOG", "warning"), metrics=False,
        gateway_replicas=args.gateway_replicas, internal_token=args.internal_auth != "none",
        internal_tls_dir=make_certs() if args.internal_auth == "mtls" else "")).start()
    try:
        print("pids", {k: p.pid for k, p in stack.processes.items()}, flush=True)
        args.workload, args.request_rate = "random", 0.0
        before = {k: _cpu_seconds(p.pid) for k, p in stack.processes.items()}
        record = asyncio.run(run_load(args, build_workload("random", args.num_requests),
                                      stack.http_url, stack.grpc_target))
        record.pop("samples", None)
        tokens = max(1, round(record["output_tok_s"] * record["seconds"]))
        # CPU time each service spent per output token: the busiest one bounds the stack.
        record["cpu_us_per_token"] = {
            k: round((_cpu_seconds(p.pid) - before[k]) / tokens * 1e6, 2)
            for k, p in stack.processes.items()}
        print(json.dumps({"step_ms": args.step_ms, "gateway_replicas": args.gateway_replicas,
                          **record}))
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
