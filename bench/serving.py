"""Online load against the gateway (OpenAI HTTP or gRPC): throughput, TTFT, ITL, errors.

    # against a running stack
    python -m bench.serving --url http://127.0.0.1:8000 --concurrency 256
    # start the five-service stack itself, and first run the same workload in-process for the ratio
    python -m bench.serving --launch --model models/configs/Qwen3-0.6B --load-format dummy \
        --compare-in-process
    # the cost of internal mTLS: the same launch with --internal-auth none, token (the
    # launcher's default) or mtls (certificates from scripts/gen_internal_certs.py)
    python -m bench.serving --launch --model ... --internal-auth mtls
    # the cost of vLLM-compatible metric names, scraped every second like Prometheus would
    python -m bench.serving --launch --model ... --scrape-interval 1 --metrics-compat vllm
    # the cost of tracing: the same load on a stack without tracing, then on one that traces
    # every request (OTLP export to an in-process collector), and the throughput ratio
    python -m bench.serving --launch --model ... --otel both

Workloads: `random` (nano-vllm's: token-id prompts, ignore_eos) or `shared-prefix` (a common system
prompt followed by a random suffix). Load: fixed concurrency, or a Poisson request rate.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench.common import jsonl
from bench.common.certs import make_certs
from bench.common.prefix_cache import counters, hit_rate
from bench.common.step_graphs import graph_steps_of
from bench.common.stream_clients import Result, grpc_request, http_request, httpx_events


def build_workload(kind: str, n: int, seed: int = 0,
                   vocab: int = 30000) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request; bench.peer.serving sends vLLM the same list.
    `generated-shared-prefix`: bench.routing's Workload (2,048-token system prompts, 8 questions
    of 128 tokens each, 256 output tokens) with ceil(n / 8) groups, its first n requests."""
    from bench.offline import workload

    if kind == "random":
        prompts, outs = workload(n, seed=seed)
        return list(zip(prompts, outs, strict=True))
    if kind == "generated-shared-prefix":
        from bench.routing import Workload

        work = Workload(num_groups=-(-n // 8), prompts_per_group=8)
        return [(p, work.output_len) for p in work.requests(seed, vocab)[:n]]
    rng = random.Random(seed)
    system = [rng.randint(0, 10000) for _ in range(512)]
    return [(system + [rng.randint(0, 10000) for _ in range(rng.randint(16, 128))],
             rng.randint(64, 256)) for _ in range(n)]


async def _drive(args, workload: list[tuple[list[int], int]], url: str, target: str
                 ) -> tuple[list[Result], float, float]:
    """One client process's share of the load: its results and wall-clock start and end."""
    sem = asyncio.Semaphore(args.concurrency)
    rng = random.Random(1)
    closers: list[Callable[[], Awaitable[object]]] = []
    if args.protocol == "http":
        import urllib.request

        from bench.common.sse_client import stream_events

        with urllib.request.urlopen(f"{url}/v1/models") as reply:
            model = json.load(reply)["data"][0]["id"]
        if getattr(args, "http_client", "lean") == "httpx":
            import httpx

            client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None))
            closers.append(client.aclose)
            events = functools.partial(httpx_events, client, url)
        else:
            events = functools.partial(stream_events, url, "/v1/completions")

        def send(p, n):
            return http_request(events, model, p, n)
    else:
        import grpc
        from minisgl_core.proto.minisgl.v1 import generation_pb2 as pb
        from minisgl_core.proto.minisgl.v1 import generation_pb2_grpc as pbg

        # Several channels (connections): with gateway replicas each lands on one of them.
        channels = [grpc.aio.insecure_channel(target,
                                              options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(args.grpc_channels)]
        closers.extend(channel.close for channel in channels)
        stubs = [pbg.GenerationStub(channel) for channel in channels]
        turn = itertools.count()

        def send(p, n):
            return grpc_request(stubs[next(turn) % len(stubs)], pb, p, n)

    from minisgl_core.progress import Counter

    bar = Counter(len(workload), desc=f"{args.protocol} x{args.concurrency}", unit="req")

    async def one(prompt: list[int], max_tokens: int) -> Result:
        async with sem:
            result = await send(prompt, max_tokens)
        bar.update()
        return result

    start = time.time()
    tasks = []
    for prompt, max_tokens in workload:
        tasks.append(asyncio.create_task(one(prompt, max_tokens)))
        if args.request_rate > 0:
            await asyncio.sleep(rng.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    end = time.time()
    bar.close()
    for close in closers:
        await close()
    return list(results), start, end


def _drive_part(args, workload, url: str, target: str, start_at: float) -> tuple:
    """A client process: waits for the common start, runs its share, returns plain tuples."""
    time.sleep(max(0.0, start_at - time.time()))
    cpu = time.process_time()
    results, start, end = asyncio.run(_drive(args, workload, url, target))
    return ([(r.ok, r.output_tokens, r.ttft, r.itls, r.error) for r in results], start, end,
            time.process_time() - cpu)


async def run_load(args, workload: list[tuple[list[int], int]], url: str, target: str) -> dict:
    """Drives the workload from `args.client_procs` processes (one event loop each), each with
    its share of the requests and of the concurrency, from a common start. The client's CPU per
    streamed token goes into the record (dev box: 38 µs with the lean HTTP client, 125 with
    httpx), so a run shows whether the load generator, not the stack, was the bound."""
    procs = max(1, getattr(args, "client_procs", 1))
    if procs == 1:
        cpu = time.process_time()
        results, start, end = await _drive(args, workload, url, target)
        client_cpu = time.process_time() - cpu
    else:
        import concurrent.futures
        import copy
        import multiprocessing

        part_args = copy.copy(args)
        part_args.concurrency = -(-args.concurrency // procs)
        if args.request_rate > 0:
            part_args.request_rate = args.request_rate / procs
        start_at = time.time() + 5.0  # spawned clients import grpc/httpx first
        loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(procs, mp_context=ctx) as pool:
            parts = await asyncio.gather(*(
                loop.run_in_executor(pool, _drive_part, part_args, workload[i::procs], url,
                                     target, start_at) for i in range(procs)))
        results = [Result(ok, n, ttft, itls, error=err)
                   for part in parts for ok, n, ttft, itls, err in part[0]]
        start, end = start_at, max(part[2] for part in parts)
        client_cpu = sum(part[3] for part in parts)
    elapsed = end - start
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    pct = lambda xs, q: round(1000 * statistics.quantiles(xs, n=100)[q - 1], 2) if len(xs) > 1 else None  # noqa: E731
    ttfts = [r.ttft for r in ok]
    itls = [x for r in ok for x in r.itls]
    return {
        "protocol": args.protocol, "workload": args.workload, "requests": len(results),
        "errors": len(results) - len(ok), "concurrency": args.concurrency,
        "request_rate": args.request_rate, "client_procs": procs, "seconds": round(elapsed, 3),
        "output_tok_s": round(tokens / elapsed, 1),
        # The load generator's own CPU per token, all its processes: when one process's share
        # nears 1e6 / output_tok_s microseconds, the client, not the stack, is the bound.
        "client_cpu_us_per_token": round(client_cpu / max(1, tokens) * 1e6, 2),
        **{f"ttft_p{q}_ms": pct(ttfts, q) for q in (50, 90, 99)},
        **{f"itl_p{q}_ms": pct(itls, q) for q in (50, 90, 99)},
        "first_errors": [r.error for r in results if not r.ok][:3],
        "samples": {"ttft_s": [round(x, 5) for x in ttfts], "itl_s": [round(x, 5) for x in itls]},
    }


def in_process(args, workload) -> float:
    from minisgl.llm import LLM
    from minisgl_core.sampling import SamplingParams

    from bench.offline import warm_up

    llm = LLM(args.model, load_format=args.load_format)
    # offline.py's warm-up (32 prompts of the workload's shape): with a single short prompt the
    # kernel variants of long prefill chunks and shrinking batches were compiled inside the timed
    # run on a fresh machine, which read the in-process rate low (17.8k against 18.3-18.6k once
    # compiled on an H100) and flattered the stack's ratio (docs/benchmarks/log/2026-11-24-10.md).
    warm_up(llm, 0.6)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for _, n in workload]
    start = time.perf_counter()
    out = llm.generate([p for p, _ in workload], params)
    rate = sum(len(r["token_ids"]) for r in out) / (time.perf_counter() - start)
    llm.close()
    return rate


async def warm_up_stack(args, url: str, target: str) -> None:
    """The in-process run's warm-up, through the stack: 32 other prompts of the workload's shape
    with 1-16 output tokens, not timed. Without it the first timed load paid for the worker's
    first long prefill chunks and the services' first connections and streams (a stack timed at
    256 streams first read ~5 % below the same stack after a sweep; docs/benchmarks/log/2026-11-24-10.md)."""
    import copy

    from bench.offline import warm_up_requests

    warm_args = copy.copy(args)
    warm_args.concurrency, warm_args.request_rate, warm_args.client_procs = 32, 0.0, 1
    warm = list(zip(*warm_up_requests(), strict=True))
    rec = await run_load(warm_args, warm, url, target)
    if rec["errors"]:
        raise SystemExit(f"the warm-up load failed: {rec['first_errors']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--grpc-target", default="127.0.0.1:50051")
    p.add_argument("--protocol", choices=["http", "grpc"], default="http")
    p.add_argument("--workload", choices=["random", "shared-prefix", "generated-shared-prefix"],
                   default="random", help="shared-prefix: one 512-token system prompt for all; "
                   "generated-shared-prefix: bench.routing's groups (see build_workload)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--concurrency", default="256",
                   help="streams in flight; a comma list runs one load per value on one stack")
    p.add_argument("--request-rate", type=float, default=0.0, help="req/s (Poisson); 0 = all")
    p.add_argument("--launch", action="store_true", help="start the stack with --model")
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--worker-args", default="")
    p.add_argument("--compare-in-process", action="store_true")
    p.add_argument("--gateway-replicas", type=int, default=1, help="with --launch")
    p.add_argument("--grpc-channels", type=int, default=8, help="per client process")
    p.add_argument("--http-client", choices=["lean", "httpx"], default="lean",
                   help="lean: bench/common/sse_client.py, a third of httpx's CPU a token; httpx: the "
                        "openai client's transport (one process saturated at ~15k tok/s)")
    p.add_argument("--client-procs", type=int, default=1,
                   help="load-generator processes sharing the requests and the concurrency")
    p.add_argument("--internal-auth", choices=["none", "token", "mtls"], default="token",
                   help="with --launch: internal RPCs open, with the per-run token, or with the "
                        "token over mTLS")
    p.add_argument("--internal-tls-dir", default="",
                   help="with --internal-auth mtls: gen_internal_certs.py's OUTDIR (default: "
                        "fresh certificates in a temp dir)")
    p.add_argument("--metrics-compat", choices=["off", "vllm"], default="off",
                   help="with --launch: the services' --metrics-compat (vLLM metric names)")
    p.add_argument("--scrape-interval", type=float, default=0.0,
                   help="with --launch: GET every /metrics this often during the load (0: never)")
    p.add_argument("--otel", choices=["off", "on", "both"], default="off",
                   help="with --launch: tracing off, on (every request traced and exported over "
                        "OTLP/gRPC to an in-process collector), or both (two stacks, one after "
                        "the other, and the on/off throughput ratio)")
    p.add_argument("--otel-sampler", default="parentbased_always_on",
                   help="OTEL_TRACES_SAMPLER of the traced stack (with --otel-sampler-arg)")
    p.add_argument("--otel-sampler-arg", default="")
    p.add_argument("--json", default=None)
    p.add_argument("--samples", default=None,
                   help="append per-request TTFT and ITL samples (JSON lines) for bench/common/plot.py")
    args = p.parse_args()
    levels = [int(x) for x in str(args.concurrency).split(",")]
    workload = build_workload(args.workload, args.num_requests, vocab=model_vocab(args.model))
    record: dict = {"bench": "serving", "engine": "minisgl"}
    if args.model:
        record.update(model=Path(args.model).name, tp=_tp_size(args.worker_args))
    if args.compare_in_process:
        record["in_process_tok_s"] = round(in_process(args, workload), 1)
    if args.otel != "off" and not args.launch:
        p.error("--otel needs --launch")
    records = []
    for otel in (["off", "on"] if args.otel == "both" else [args.otel]):
        records += _run_stack(args, levels, workload, record, otel)
    by_mode = {(r.get("otel"), r["concurrency"]): r["output_tok_s"] for r in records
               if "concurrency" in r}
    for level in levels:
        if ("off", level) in by_mode and ("on", level) in by_mode and by_mode[("off", level)]:
            ratio = {"concurrency": level, "otel_on_over_off": round(
                by_mode[("on", level)] / by_mode[("off", level)], 4)}
            print(json.dumps(ratio), flush=True)
    jsonl.append(args.json, records)
    return 0


def model_vocab(model: str | None) -> int:
    """The id range generated prompts draw from: bench.routing's 30,000, or a smaller vocabulary."""
    if not model or not (Path(model) / "config.json").is_file():
        return 30000
    return int(json.loads((Path(model) / "config.json").read_text()).get("vocab_size", 30000))


def _tp_size(worker_args: str) -> int:
    import shlex

    words = shlex.split(worker_args)
    for i, word in enumerate(words):
        if word == "--tp-size" and i + 1 < len(words):
            return int(words[i + 1])
        if word.startswith("--tp-size="):
            return int(word.split("=", 1)[1])
    return 1


def _metrics_urls(stack: object, service: str = "scheduler") -> list[str]:
    """Every scheduler's (or worker's) /metrics of a launched stack (none without --launch)."""
    if stack is None:
        return []
    ports = stack.metrics_ports  # type: ignore[attr-defined]
    keys = [stack.engine_key(service, i)  # type: ignore[attr-defined]
            for i in range(stack.engines)]  # type: ignore[attr-defined]
    return [f"http://127.0.0.1:{ports[k]}/metrics" for k in keys if ports.get(k)]


def _run_stack(args, levels: list[int], workload, record: dict, otel: str) -> list[dict]:
    """Launch a stack (with --launch; tracing per `otel`), run each load level, stop it."""
    stack = sink = None
    env: dict[str, str] = {}
    if otel == "on":
        from minisgl_core.otlp_sink import OtlpSink

        sink = OtlpSink(keep=False).start()  # counts spans, keeps none
        env = sink.env(args.otel_sampler)
        if args.otel_sampler_arg:
            env["OTEL_TRACES_SAMPLER_ARG"] = args.otel_sampler_arg
    if args.launch:
        record = {**record, "otel": otel}
        import shlex

        from minisgl.launcher import Stack, StackConfig
        from minisgl_core.ports import free_port

        worker_args = ["--load-format", args.load_format, *shlex.split(args.worker_args)]
        tls_dir = ""
        if args.internal_auth == "mtls":
            tls_dir = args.internal_tls_dir or make_certs()
        record["internal_auth"] = args.internal_auth
        stack = Stack(StackConfig(model_path=args.model, http_port=free_port(),
                                  grpc_port=free_port(),
                                  internal_ports=dict.fromkeys(
                                      ("worker", "tokenizer", "detokenizer", "scheduler"), 0),
                                  extra_args={"worker": worker_args},
                                  log_dir=Path("/tmp/minisgl-bench-logs"), log_level="warning",
                                  gateway_replicas=args.gateway_replicas,
                                  internal_token=args.internal_auth != "none",
                                  internal_tls_dir=tls_dir,
                                  env={**env, "MINISGL_METRICS_COMPAT": args.metrics_compat},
                                  startup_timeout=900)).start()
        args.url, args.grpc_target = stack.http_url, stack.grpc_target
        record["metrics_compat"] = args.metrics_compat
    records = []
    try:
        asyncio.run(warm_up_stack(args, args.url, args.grpc_target))
        for level in levels:
            args.concurrency = level
            scraper = None
            if stack is not None and args.scrape_interval > 0:
                from bench.common.metrics_scraper import Scraper, stack_metrics_urls

                scraper = Scraper(stack_metrics_urls(stack.http_url, stack.metrics_ports),
                                  args.scrape_interval).start()
            cache_urls = _metrics_urls(stack)
            before = [counters(u, "minisgl") for u in cache_urls]
            graphs_before = graph_steps_of(_metrics_urls(stack, "worker"))
            rec = {**record, **asyncio.run(run_load(args, workload, args.url, args.grpc_target))}
            if stack is not None:  # the workers' steps of this load by how they ran
                after = graph_steps_of(_metrics_urls(stack, "worker"))
                rec["worker_steps_by_graph"] = {g: int(n - graphs_before.get(g, 0.0))
                                                for g, n in sorted(after.items())}
            if cache_urls:  # prefix-cache hit rate over this load, as bench.peer.serving's
                after = [counters(u, "minisgl") for u in cache_urls]
                rec["hit_rate"] = hit_rate(tuple(map(sum, zip(*before, strict=True))),
                                           tuple(map(sum, zip(*after, strict=True))))
            if scraper is not None:
                rec.update(scraper.stop())
            samples = rec.pop("samples")
            if "in_process_tok_s" in rec:
                rec["stack_over_in_process"] = round(rec["output_tok_s"]
                                                     / rec["in_process_tok_s"], 3)
            records.append(rec)
            print(json.dumps(rec), flush=True)
            if args.samples:
                with open(args.samples, "a") as f:
                    f.write(json.dumps({"protocol": args.protocol, "concurrency": level,
                                        **samples}) + "\n")
    finally:
        if stack is not None:
            stack.stop()
        if sink is not None:  # after the stop: the services flush their spans at exit
            for rec in records:
                rec["otel_spans_received"] = sink.count
            print(json.dumps({"otel": otel, "otel_spans_received": sink.count}), flush=True)
            sink.stop()
    return records


if __name__ == "__main__":
    sys.exit(main())
