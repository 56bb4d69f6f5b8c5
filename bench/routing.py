"""Scale-out routing benchmark: E engines (one per GPU) behind gateways with each routing policy,
against one engine and one TP=2 engine, on a generated-shared-prefix workload in the style of
SGLang's `bench_serving --dataset-name generated-shared-prefix`.

    # GPU (2 GPUs): 2 engines x {round_robin, least_load, cache_aware}, 1 engine, 1 TP=2 engine
    python -m bench.routing --model models/configs/Qwen3-0.6B --load-format dummy --engines 2
    # CPU smoke with the tiny model (tiny numbers; tests/routing/test_bench_routing.py)
    python -m bench.routing --device cpu --model models/tiny --num-groups 4 \
        --prompts-per-group 3 --system-prompt-len 64 --question-len 8 --output-len 4 \
        --modes routed,single --policies round_robin,cache_aware

Workload: `num_groups` system prompts of `system_prompt_len` random token ids, each followed by
`prompts_per_group` questions of `question_len` ids; all requests (shuffled) go out at once, at
most `concurrency` in flight, each generating `output_len` tokens (ignore_eos). Every policy runs
on the same engines with fresh prompts (a different seed), so none finds another's prefixes.
Output: one JSON line per run (mode, policy, throughput, TTFT p50/p90/p99 and p50/p99 past the
opening burst, prefix-cache hit rate from the engines' own metrics, errors; per engine the
requests it finished, its preemptions, the p50/p99 of its queue time (arrival to first
scheduled, from its histogram: a bucket's upper bound), and the longest waiting queue and most
running requests its load showed, polled every 50 ms), the parameters on each. `--gateway-args`
passes flags to every gateway (e.g. a balance threshold); a policy written `name:flags` (e.g.
`cache_aware:--routing-queue-slack=-1`) adds flags to that run's gateways only, so variants of
one policy compare on the same engines. `--repeats N` runs the policies in N interleaved rounds;
a last line summarizes each variant over its runs (`summarize`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from minisgl.launcher import Stack, StackConfig
from minisgl_core.ports import free_port
from minisgl_core.serving import wait_for_health

from bench.common import jsonl
from bench.common.engine_probe import LoadProbe, scrape
from bench.common.stream_clients import grpc_request

LOG_DIR = Path("/tmp/minisgl-bench-routing")


@dataclass(frozen=True)
class Workload:
    num_groups: int = 128
    prompts_per_group: int = 8
    system_prompt_len: int = 2048
    question_len: int = 128
    output_len: int = 256

    def requests(self, seed: int, vocab: int) -> list[list[int]]:
        rng = random.Random(seed)
        top = min(vocab, 30000)
        systems = [[rng.randrange(10, top) for _ in range(self.system_prompt_len)]
                   for _ in range(self.num_groups)]
        out = [s + [rng.randrange(10, top) for _ in range(self.question_len)]
               for s in systems for _ in range(self.prompts_per_group)]
        rng.shuffle(out)
        return out


# -- client (in worker processes: one Python event loop tops out well below two GPUs) ----------

_Result = tuple[bool, float, int, str, bool]  # ok, TTFT, output tokens, error, in the burst


async def _one(stub: object, pb: object, prompt: list[int], output_len: int,
               sem: asyncio.Semaphore, burst: bool) -> _Result:
    async with sem:
        r = await grpc_request(stub, pb, prompt, output_len, temperature=0.0)
    return r.ok, r.ttft, r.output_tokens, r.error[:200], burst


async def _drive(target: str, prompts: list[list[int]], output_len: int,
                 concurrency: int) -> list[_Result]:
    import grpc
    from minisgl_core.proto.minisgl.v1 import generation_pb2, generation_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        sem = asyncio.Semaphore(max(1, concurrency))
        # The semaphore is FIFO: the first `concurrency` requests go out at once (the burst).
        return await asyncio.gather(*(_one(stub, generation_pb2, p, output_len, sem,
                                           i < concurrency) for i, p in enumerate(prompts)))


def _drive_part(target: str, prompts: list[list[int]], output_len: int,
                concurrency: int) -> list[_Result]:
    return asyncio.run(_drive(target, prompts, output_len, concurrency))


# -- engines and gateways ---------------------------------------------------------------------

def _start_gateways(stack: Stack, schedulers: list[str], policy: str, replicas: int,
                    gateway_args: str = "") -> tuple[str, list[subprocess.Popen[bytes]]]:
    http, grpc_port = free_port(), free_port()
    procs = []
    for i in range(replicas):
        cmd = [sys.executable, "-m", "minisgl_gateway", "--port", str(http), "--grpc-port",
               str(grpc_port), "--tokenizer", stack.target("tokenizer"), "--detokenizer",
               stack.target("detokenizer"), "--scheduler", ",".join(schedulers), "--routing",
               policy, "--max-concurrent-requests", "100000", "--log-level", "warning",
               *shlex.split(gateway_args)]
        if replicas > 1:
            cmd.append("--reuse-port")
        log = open(LOG_DIR / f"gateway-{policy}-{http}-{i}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        if i == 0:
            wait_for_health(f"127.0.0.1:{grpc_port}", timeout=120)
        else:  # the shared port may answer from an older replica: wait for this one to listen
            _wait_replica(proc, http, grpc_port)
    return f"127.0.0.1:{grpc_port}", procs


def _wait_replica(proc: subprocess.Popen[bytes], http: int, grpc_port: int) -> None:
    """Until `proc` listens on both ports and /ready answers 200 on 16 fresh connections in a
    row (the kernel spreads them over the replicas, so a replica not ready yet would show)."""
    from minisgl.launcher import _listening_ports

    deadline, in_a_row = time.monotonic() + 120, 0
    while in_a_row < 16:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"gateway replica on :{http} did not start (see {LOG_DIR})")
        ready = False
        if _listening_ports(proc.pid) >= {http, grpc_port}:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/ready", timeout=5) as r:
                    ready = r.status == 200
            except OSError:
                ready = False
        in_a_row = in_a_row + 1 if ready else 0
        if not ready:
            time.sleep(0.1)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(60)


def run_one(args: argparse.Namespace, stack: Stack, engines: list[int], mode: str, policy: str,
            seed: int) -> dict[str, object]:
    work = Workload(args.num_groups, args.prompts_per_group, args.system_prompt_len,
                    args.question_len, args.output_len)
    keys = [stack.engine_key("scheduler", i) for i in engines]
    policy, _, own_args = policy.partition(":")
    gateway_args = " ".join(a for a in (args.gateway_args, own_args) if a)
    target, gateways = _start_gateways(stack, [stack.target(k) for k in keys], policy,
                                       args.gateway_replicas, gateway_args)
    try:
        _drive_part(target, [[7, 8, 9, 10]], 4, 1)  # warm-up: one short request
        config = json.loads((Path(args.model) / "config.json").read_text())
        prompts = work.requests(seed, int(config.get("vocab_size", 30000)))
        before = [scrape(stack.metrics_ports[k]) for k in keys]
        parts = max(1, min(args.client_processes, len(prompts)))
        slices = [prompts[i::parts] for i in range(parts)]
        with ProcessPoolExecutor(parts) as pool:
            pool.submit(int).result()  # fork the clients before the probe opens gRPC channels
            probe = LoadProbe([stack.target(k) for k in keys]).start()
            start = time.perf_counter()
            try:
                futures = [pool.submit(_drive_part, target, s, work.output_len,
                                       -(-args.concurrency // parts)) for s in slices]
                results = [r for f in futures for r in f.result()]
                elapsed = time.perf_counter() - start
            finally:
                traces = probe.stop()
        after = [scrape(stack.metrics_ports[k]) for k in keys]
    finally:
        _stop(gateways)
    ok = [r for r in results if r[0]]
    ttfts = sorted(r[1] for r in ok if r[1])
    later = sorted(r[1] for r in ok if r[1] and not r[4])
    deltas = [a.minus(b) for a, b in zip(after, before, strict=True)]
    hits, queries = sum(d.hits for d in deltas), sum(d.queries for d in deltas)

    def pct(q: float, xs: list[float] = ttfts) -> float:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else 0.0

    return {
        "mode": mode, "policy": policy, "engines": len(engines),
        "tp": args.tp if mode == "tp" else 1, "requests": len(results), "errors": len(results)
        - len(ok), "first_error": next((r[3] for r in results if not r[0]), ""),
        "seconds": round(elapsed, 2),
        "output_tok_s": round(sum(r[2] for r in ok) / elapsed, 1),
        "request_s": round(len(ok) / elapsed, 2),
        "ttft_p50_s": round(statistics.median(ttfts), 4) if ttfts else 0.0,
        "ttft_p90_s": pct(0.90), "ttft_p99_s": pct(0.99),
        # Past the opening burst (the first `concurrency` requests, all sent at once): steady
        # state, where a request waits only for what routing put ahead of it.
        "ttft_after_burst_p50_s": pct(0.5, later), "ttft_after_burst_p99_s": pct(0.99, later),
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
        # per engine: a TTFT tail made of queueing inside an engine shows in its queue times
        "engine_requests": [int(d.finished) for d in deltas],
        "engine_queue_p50_s": [d.queue_quantile(0.5) for d in deltas],
        "engine_queue_p99_s": [d.queue_quantile(0.99) for d in deltas],
        "engine_preemptions": [int(d.preemptions) for d in deltas],
        "engine_max_waiting": [t.max_waiting for t in traces],
        "engine_max_running": [t.max_running for t in traces],
        **asdict(work), "concurrency": args.concurrency,
        "gateway_replicas": args.gateway_replicas, "gateway_args": gateway_args,
        "model": args.model,
        "device": args.device,
    }


def _stack(args: argparse.Namespace, engines: int, tp: int) -> Stack:
    worker = ["--load-format", args.load_format, "--device", args.device,
              *shlex.split(args.worker_args)]
    env: dict[int, dict[str, str]] = {}
    if args.device != "cpu":
        if tp > 1:
            worker += ["--tp-size", str(tp)]
            env = {0: {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(tp))}}
        else:  # engine i on GPU i
            env = {i: {"CUDA_VISIBLE_DEVICES": str(i)} for i in range(engines)}
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    return Stack(StackConfig(
        model_path=args.model, http_port=free_port(), grpc_port=free_port(),
        internal_ports=dict.fromkeys(("worker", "tokenizer", "detokenizer", "scheduler"), 0),
        extra_args={"worker": worker, "scheduler": shlex.split(args.scheduler_args)},
        log_dir=LOG_DIR, log_level="warning", engine_replicas=engines, engine_env=env,
        internal_token=False,
        startup_timeout=900)).start()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = Workload()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="models/configs/Qwen3-0.6B")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="cuda", help="cuda (engine i on GPU i) or cpu")
    p.add_argument("--engines", type=int, default=2, help="engines of the routed runs")
    p.add_argument("--tp", type=int, default=2, help="TP size of the `tp` mode's single engine")
    p.add_argument("--modes", default="routed,single,tp",
                   help="routed: --engines engines per policy; single: one engine (GPU 0); "
                        "tp: one engine with --tp GPUs")
    p.add_argument("--policies", default="round_robin,least_load,cache_aware")
    p.add_argument("--num-groups", type=int, default=d.num_groups)
    p.add_argument("--prompts-per-group", type=int, default=d.prompts_per_group)
    p.add_argument("--system-prompt-len", type=int, default=d.system_prompt_len)
    p.add_argument("--question-len", type=int, default=d.question_len)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--concurrency", type=int, default=512, help="requests in flight at most")
    p.add_argument("--gateway-replicas", type=int, default=4,
                   help="gateway processes per run (SO_REUSEPORT; one carries ~10k tok/s)")
    p.add_argument("--client-processes", type=int, default=4)
    p.add_argument("--worker-args", default="")
    p.add_argument("--scheduler-args", default="")
    p.add_argument("--gateway-args", default="",
                   help="extra gateway flags, e.g. \"--routing-balance-threshold 8\"")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of the routed policies (interleaved); the summary line gives "
                        "each variant's means and medians over them")
    p.add_argument("--json", default="", help="also append the JSON lines to this file")
    return p.parse_args(argv)


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per routed variant (policy and its gateway flags) over its runs: mean throughput (and its
    ratio to the single engine's, when one ran), mean hit rate, median TTFT p50 and p99. One
    variant's TTFT p99 varies by seconds between runs on a saturated pair of engines: compare
    medians over `--repeats`."""
    single = next((r for r in records if r["mode"] == "single"), None)
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r["mode"] == "routed":
            runs.setdefault(f"{r['policy']} {r['gateway_args']}".strip(), []).append(r)
    out = {}
    for name, rs in runs.items():
        tok_s = statistics.mean(float(r["output_tok_s"]) for r in rs)
        row = {"runs": len(rs), "output_tok_s": round(tok_s, 1),
               "hit_rate": round(statistics.mean(float(r["hit_rate"]) for r in rs), 4),
               "ttft_p50_s": round(statistics.median(float(r["ttft_p50_s"]) for r in rs), 4),
               "ttft_p99_s": round(statistics.median(float(r["ttft_p99_s"]) for r in rs), 4)}
        if single and float(single["output_tok_s"]):
            row["x_single"] = round(tok_s / float(single["output_tok_s"]), 3)
        out[name] = row
    return out


def _servable(model: str) -> str:
    """A config-only directory (models/configs/*) gets a synthetic tokenizer beside a copy of its
    config (bench.common.model_dir), as the other stack benchmarks do."""
    path = Path(model)
    if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
        return model
    from bench.common.model_dir import make

    return str(make(model, f"/tmp/minisgl-bench-model-{path.name}"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.model = _servable(args.model)
    modes = [m for m in args.modes.split(",") if m]
    policies = [p for p in args.policies.split(",") if p]
    records: list[dict[str, object]] = []

    def emit(rec: dict[str, object]) -> None:
        records.append(rec)
        print(json.dumps(rec), flush=True)

    seed = 1
    if "routed" in modes or "single" in modes:
        engines = args.engines if "routed" in modes else 1
        stack = _stack(args, engines, 1)
        try:
            if "routed" in modes:
                for _ in range(max(1, args.repeats)):  # rounds of every policy: interleaved
                    for policy in policies:
                        emit(run_one(args, stack, list(range(engines)), "routed", policy, seed))
                        seed += 1
            if "single" in modes:  # engine 0 alone, the others idle
                emit(run_one(args, stack, [0], "single", "round_robin", seed))
                seed += 1
        finally:
            stack.stop()
    if "tp" in modes:
        if args.device == "cpu":
            print(json.dumps({"mode": "tp", "skipped": "TP needs GPUs"}), flush=True)
        else:
            stack = _stack(args, 1, args.tp)
            try:
                emit(run_one(args, stack, [0], "tp", "round_robin", seed))
            finally:
                stack.stop()
    if any(r["mode"] == "routed" for r in records):
        emit({"summary": summarize(records)})
    jsonl.append(args.json, records)
    return 0 if all(not r.get("errors") for r in records) else 1


if __name__ == "__main__":
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    sys.exit(main())
