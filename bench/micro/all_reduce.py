"""All-reduce latency on this host's GPUs: NCCL against the one-shot CUDA IPC kernel
(kernels/all_reduce.py, both its protocols), per message size, each op timed inside a CUDA graph
of `--ops` back-to-back all-reduces (how a decode step issues them). Checks the kernel's sums
first (bf16 and fp32, odd sizes alternating call to call, eager and graph-replayed).

    python -m bench.micro.all_reduce --world 2 [--json FILE]

One JSON line per size: {"bytes", "nccl_us", "custom_us", "speedup", "ar_then_norm_us",
"fused_norm_us"} for the default (Lamport) protocol, "barrier_us" / "barrier_fused_norm_us"
for the flag-barrier one, and from 1 MiB "nccl_then_norm_us" / "two_shot_norm_us" (NCCL and the
fused add+RMSNorm kernel, against kernels/two_shot.py); exits 1 if a check fails.
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

from bench.common import jsonl
from bench.common.gpu_timing import graph_us

SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20,
         32 << 20, 64 << 20]


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
    bad += _check_add_rmsnorm(ar, rank, device)
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


def _check_add_rmsnorm(ar: Any, rank: int, device: torch.device) -> list[str]:
    """The one-shot fused kernel against its own plain all-reduce then the norm kernel."""
    return _check_fused_norm("add_rmsnorm", ar.add_rmsnorm, ar,
                             ((1, 4096), (3, 1024), (200, 4096), (512, 1024)), rank, device)


def _check_two_shot(ts: Any, rank: int, device: torch.device) -> list[str]:
    """The two-shot fused kernel against NCCL's sum then the norm kernel (on two ranks NCCL's
    bf16 sum is one rounded addition, as ours); row counts that split unevenly over the ranks
    and programs, alternating call to call."""
    return _check_fused_norm(
        "two-shot", ts.add_rmsnorm, dist.all_reduce,
        ((1, 4096), (4097, 4096), (3, 1024), (1000, 4096), (2049, 1024), (8, 4096)), rank, device)


def _check_fused_norm(name: str, fused: Any, plain_sum: Any, cases: tuple[tuple[int, int], ...],
                      rank: int, device: torch.device) -> list[str]:
    """`fused(x, residual, w, eps)`, an all-reduce fused with the residual add and RMSNorm,
    against `plain_sum(x)` (in place) followed by the fused add+RMSNorm kernel: x left as it
    is, the new residual bit for bit, the normed rows within bf16 rounding."""
    from minisgl_worker.kernels import fused_ops

    bad = []
    for rows, d in cases:
        g = torch.Generator(device=device).manual_seed(rows * 7 + d + rank)
        x = torch.randn(rows, d, generator=g, device=device).to(torch.bfloat16)
        shared = torch.Generator(device=device).manual_seed(rows + d)  # alike on every rank
        res = torch.randn(rows, d, generator=shared, device=device).to(torch.bfloat16)
        w = torch.rand(d, generator=shared, device=device).to(torch.bfloat16) + 0.5
        summed, res_ref = x.clone(), res.clone()
        plain_sum(summed)
        want = fused_ops.rmsnorm(summed, w, 1e-6, residual=res_ref)
        res_got, x_in = res.clone(), x.clone()
        got = fused(x, res_got, w, 1e-6)
        if not torch.equal(x, x_in):
            bad.append(f"{name} rows={rows} d={d}: the input changed")
        if not torch.equal(res_got, res_ref):
            bad.append(f"{name} rows={rows} d={d}: residual differs")
        err = (got.float() - want.float()).abs().max().item()
        if err > 2e-2 * want.float().abs().max().item():
            bad.append(f"{name} rows={rows} d={d}: out max err {err}")
        elif rank == 0:
            print(f"{name} rows={rows} d={d}: residual exact, out "
                  f"{'exact' if torch.equal(got, want) else f'max err {err:.3g}'}", flush=True)
    return bad


def _time(fn: Any, x: torch.Tensor, ops: int) -> float:
    """Microseconds per all-reduce inside a graph of `ops` of them (the ranks replay their
    graphs together: every all-reduce in them waits for the other ranks)."""
    return graph_us(lambda _: fn(x), iters=10, layers=ops)


def _time_norms(ar: Any, x: torch.Tensor, ops: int, device: torch.device) -> dict[str, float]:
    """A layer's tail: all-reduce then add+RMSNorm (two kernels) against the fused kernel."""
    from minisgl_worker.kernels import fused_ops

    res, w = torch.zeros_like(x), torch.ones(x.shape[1], dtype=x.dtype, device=device)

    def two(t: torch.Tensor) -> None:
        fused_ops.rmsnorm(ar(t), w, 1e-6, residual=res)

    def one(t: torch.Tensor) -> None:
        ar.add_rmsnorm(t, res, w, 1e-6)

    return {"ar_then_norm_us": round(_time(two, x, ops), 2),
            "fused_norm_us": round(_time(one, x, ops), 2)}


def _time_two_shot(ts: Any, x: torch.Tensor, ops: int, device: torch.device) -> dict[str, float]:
    """A prefill layer's tail: NCCL's all-reduce then add+RMSNorm, against the two-shot kernel."""
    from minisgl_worker.kernels import fused_ops

    res, w = torch.zeros_like(x), torch.ones(x.shape[1], dtype=x.dtype, device=device)

    def nccl(t: torch.Tensor) -> None:
        dist.all_reduce(t)
        fused_ops.rmsnorm(t, w, 1e-6, residual=res)

    return {"nccl_then_norm_us": round(_time(nccl, x, ops), 2),
            "two_shot_norm_us": round(_time(lambda t: ts.add_rmsnorm(t, res, w, 1e-6), x, ops),
                                      2)}


def _rank_main(rank: int, world: int, port: int, ops: int, out: Any) -> None:
    from minisgl_worker.kernels.all_reduce import OneShotAllReduce
    from minisgl_worker.kernels.two_shot import TwoShotAddRMSNorm

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    cpu = dist.new_group(backend="gloo")
    ars = {p: OneShotAllReduce.create(rank, world, cpu, device, max_bytes=max(SIZES), protocol=p)
           for p in ("lamport", "barrier")}
    ar = ars["lamport"]
    if ar is None:
        out.put((rank, {"error": "no peer access between the GPUs"}))
        return
    two_shot = TwoShotAddRMSNorm.create(rank, world, cpu, device, max(SIZES), ar.programs)
    print(f"rank {rank}: peer buffers mapped", flush=True)
    bad = []
    for proto, each in ars.items():
        bad += [f"{proto}: {b}" for b in _check(each, rank, world, device)]
    bad += _check_two_shot(two_shot, rank, device)
    print(f"rank {rank}: checks done ({len(bad)} failed)", flush=True)
    rows = []
    for nbytes in SIZES:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
        row: dict[str, Any] = {"bytes": nbytes,
                               "nccl_us": round(_time(lambda t: dist.all_reduce(t), x, ops), 2)}
        for proto, each in ars.items():
            if each is None or not each.supports(x):
                continue
            key = "custom" if proto == "lamport" else proto
            row[f"{key}_us"] = round(_time(each, x, ops), 2)
            if x.numel() % 4096 == 0:
                norms = _time_norms(each, x.view(-1, 4096), ops, device)
                if proto == "lamport":
                    row.update(norms)
                else:
                    row["barrier_fused_norm_us"] = norms["fused_norm_us"]
        if nbytes >= 1 << 20:  # prefill-chunk sizes: the two-shot kernel against NCCL + norm
            row.update(_time_two_shot(two_shot, x.view(-1, 4096), ops, device))
        if "custom_us" in row:
            row["speedup"] = round(row["nccl_us"] / row["custom_us"], 2)
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
        jsonl.append(a.json, [row])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
