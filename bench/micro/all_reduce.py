"""All-reduce latency on this host's GPUs: NCCL against the one-shot CUDA IPC kernel
(kernels/all_reduce.py), per message size, each op timed inside a CUDA graph of `--ops` back-to-back
all-reduces (how a decode step issues them). Checks the kernel's sums first (bf16 and fp32,
odd sizes, eager and graph-replayed, sizes alternating so programs' epochs drift apart).

    python -m bench.micro.all_reduce --world 2 [--json FILE]

One JSON line per size: {"bytes", "nccl_us", "push_us", "pull_us", "push_speedup", ...} (both
variants of the kernel); exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]


def _check(ar: Any, rank: int, world: int, device: torch.device) -> list[str]:
    """Every rank fills x with a rank-and-call dependent pattern; the sum is known exactly."""
    bad = []
    sizes = [1, 7, 1000, 4096, 4096 * 37 + 5, 1 << 20, (4 << 20) + 1]
    for dtype in (torch.bfloat16, torch.float32):
        for call, n in enumerate(sizes * 3):  # sizes alternate: grids differ call to call
            if not ar.supports(torch.empty(n, dtype=dtype, device=device)):
                continue
            g = torch.Generator(device=device).manual_seed(1000 * call + 7)
            parts = [torch.randint(-8, 8, (n,), generator=g, device=device).to(dtype)
                     for _ in range(world)]
            want = torch.stack([p.float() for p in parts]).sum(0).to(dtype)
            x = parts[rank].clone()
            ar(x)
            if not torch.equal(x, want):
                bad.append(f"eager {dtype} n={n} call={call}: max err "
                           f"{(x.float() - want.float()).abs().max().item()}")
    # graph replays: the captured kernel keeps counting epochs
    n = 4096 * 64
    x = torch.zeros(n, dtype=torch.bfloat16, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        ar(x)  # warm (compiles)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):
            ar(x)
    for rep in range(5):
        x.fill_(float(rank + rep))
        graph.replay()
        base = sum(r + rep for r in range(world))
        want_val = base * world ** 2  # three reductions: sum, then x world, then x world
        if not bool((x == want_val).all()):
            bad.append(f"graph replay {rep}: got {x[0].item()} want {want_val}")
    torch.cuda.synchronize(device)
    return bad


def _time(fn: Any, x: torch.Tensor, ops: int, device: torch.device) -> float:
    """Microseconds per all-reduce inside a graph of `ops` of them."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            fn(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize(device)
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * ops)


def _rank_main(rank: int, world: int, port: int, ops: int, out: Any) -> None:
    from minisgl_worker.kernels.all_reduce import OneShotAllReduce

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    cpu = dist.new_group(backend="gloo")
    kernels = {mode: OneShotAllReduce.create(rank, world, cpu, device, max_bytes=max(SIZES),
                                             push=mode == "push") for mode in ("push", "pull")}
    if any(ar is None for ar in kernels.values()):
        out.put((rank, {"error": "no peer access between the GPUs"}))
        return
    print(f"rank {rank}: peer buffers mapped", flush=True)
    bad = []
    for mode, ar in kernels.items():
        bad += [f"{mode}: {b}" for b in _check(ar, rank, world, device)]
    print(f"rank {rank}: checks done ({len(bad)} failed)", flush=True)
    rows = []
    for nbytes in SIZES:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
        row: dict[str, Any] = {"bytes": nbytes,
                               "nccl_us": round(_time(lambda t: dist.all_reduce(t), x, ops,
                                                      device), 2)}
        for mode, ar in kernels.items():
            if ar is not None and ar.supports(x):
                row[f"{mode}_us"] = round(_time(ar, x, ops, device), 2)
                row[f"{mode}_speedup"] = round(row["nccl_us"] / row[f"{mode}_us"], 2)
        rows.append(row)
    out.put((rank, {"bad": bad, "rows": rows, "device": torch.cuda.get_device_name(device)}))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--ops", type=int, default=50, help="all-reduces per timed graph")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if torch.cuda.device_count() < a.world:
        print(f"needs {a.world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ[k] = v  # never NVLink multicast on these machines
    from minisgl_worker.distributed import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, a.world, port, a.ops, q))
             for r in range(a.world)]
    for pr in procs:
        pr.start()
    results: dict[int, Any] = {}
    while len(results) < len(procs):  # a rank that dies (a kernel fault) must not hang us
        try:
            rank, res = q.get(timeout=1.0)
            results[rank] = res
        except queue.Empty:
            dead = [r for r, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
            if dead:
                print(f"rank(s) {dead} died (exit codes "
                      f"{[procs[r].exitcode for r in dead]})", file=sys.stderr)
                for pr in procs:
                    pr.kill()
                return 1
    for pr in procs:
        pr.join(60)
    ok = True
    for r in range(a.world):
        res = results[r]
        if "error" in res:
            print(json.dumps({"rank": r, **res}))
            return 1
        for b in res["bad"]:
            print(f"rank {r}: {b}", file=sys.stderr)
            ok = False
    for row in results[0]["rows"]:
        row.update(world=a.world, device=results[0]["device"], check="ok" if ok else "FAILED")
        print(json.dumps(row))
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
