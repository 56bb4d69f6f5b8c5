"""A rough event-driven model of bench.routing's workload through the gateway's real routing code
(Router, EngineView, headroom) with modelled engines, to compare policies and thresholds without
GPUs. Its numbers are the model's, not measurements: use it to see where a TTFT tail comes from
(which requests wait, for slots or for KV) and to rank settings, then measure on GPUs.

    python -m bench.routing_model --seeds 1,2,3,4 --policies round_robin,cache_aware \\
        --thresholds 2,8,32

Engines: `slots` running requests at most, `pages` KV pages of `page_size` tokens, a prefill
budget of `budget` tokens a step, first come first served admission that waits for pages, a
prefix cache of whole system prompts with LRU eviction of the unlocked ones, and a step time
linear in decoding requests and prefill tokens (about Qwen3-0.6B on an H200). Gateways get each
engine's load every 100 ms (staggered) as of its last step, and its cache changes at each step
end. Clients: `concurrency` requests in flight in `clients` closed loops, each client bound to one
gateway at random (as SO_REUSEPORT binds a connection), all starting at once.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from minisgl_core.prefix_hash import page_hashes
from minisgl_core.proto.minisgl.v1 import scheduler_pb2
from minisgl_gateway.engine_view import EngineView
from minisgl_gateway.routing import Router


@dataclass(frozen=True)
class Model:
    groups: int = 256
    per_group: int = 8
    system: int = 2048
    question: int = 128
    output: int = 256
    engines: int = 2
    slots: int = 256
    pages: int = 6250
    page_size: int = 64
    budget: int = 8192
    gateways: int = 4
    clients: int = 4
    concurrency: int = 512
    report_s: float = 0.1
    step_s: float = 0.008  # fixed cost of a step
    decode_s: float = 0.00003  # per decoding request
    prefill_s: float = 0.0000035  # per prefill token


@dataclass
class Req:
    group: int
    ids: list[int]
    client: int
    arrive: float
    prefill_left: int = 0
    out: int = 0
    ttft: float = -1.0
    hit: bool = False


@dataclass
class Engine:
    m: Model
    waiting: deque[Req] = field(default_factory=deque)
    running: list[Req] = field(default_factory=list)
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)  # groups, LRU first
    locks: dict[int, int] = field(default_factory=dict)  # running requests per group
    arrivals: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0
    max_waiting: int = 0
    stepping: bool = False
    report: scheduler_pb2.EngineLoad = field(default_factory=scheduler_pb2.EngineLoad)
    changes: list[tuple[int, bool]] = field(default_factory=list)  # (group, cached) this step

    def _group_pages(self) -> int:
        return self.m.system // self.m.page_size

    def _private_pages(self) -> int:
        return -(-(self.m.question + self.m.output) // self.m.page_size)

    def used(self) -> int:
        locked = sum(1 for n in self.locks.values() if n)
        return len(self.running) * self._private_pages() + locked * self._group_pages()

    def _free(self) -> int:
        unlocked = sum(1 for g in self.cache if not self.locks.get(g))
        return self.m.pages - self.used() - unlocked * self._group_pages()

    def _admit(self, r: Req) -> bool:
        hit = r.group in self.cache
        need = self._private_pages() + (0 if hit else self._group_pages())
        free = self._free()
        while need > free:  # evict the least recently used unlocked prefix
            victim = next((g for g in self.cache if not self.locks.get(g) and g != r.group),
                          None)
            if victim is None:
                return False
            del self.cache[victim]
            self.changes.append((victim, False))
            free += self._group_pages()
        r.hit = hit
        self.hit_tokens += self.m.system if hit else 0
        self.query_tokens += self.m.system + self.m.question
        r.prefill_left = self.m.question + (0 if hit else self.m.system)
        if not hit:
            self.cache[r.group] = None
            self.changes.append((r.group, True))
        self.cache.move_to_end(r.group)
        self.locks[r.group] = self.locks.get(r.group, 0) + 1
        self.running.append(r)
        return True

    def step(self, now: float) -> tuple[float, list[Req]]:
        budget, prefill = self.m.budget, 0
        for r in self.running:
            if r.prefill_left and budget > 0:
                n = min(budget, r.prefill_left)
                r.prefill_left, budget, prefill = r.prefill_left - n, budget - n, prefill + n
        while self.waiting and budget > 0 and len(self.running) < self.m.slots:
            r = self.waiting[0]
            if not self._admit(r):
                break
            self.waiting.popleft()
            n = min(budget, r.prefill_left)
            r.prefill_left, budget, prefill = r.prefill_left - n, budget - n, prefill + n
        decoding = [r for r in self.running if not r.prefill_left]
        end = now + self.m.step_s + self.m.decode_s * len(decoding) + self.m.prefill_s * prefill
        done = []
        for r in decoding:
            if r.ttft < 0:
                r.ttft = end - r.arrive
            r.out += 1
            if r.out >= self.m.output:
                done.append(r)
        for r in done:
            self.running.remove(r)
            self.locks[r.group] -= 1
        self.max_waiting = max(self.max_waiting, len(self.waiting))
        self.report = scheduler_pb2.EngineLoad(
            running_requests=len(self.running), waiting_requests=len(self.waiting),
            used_pages=self.used(), total_pages=self.m.pages, max_running_requests=self.m.slots,
            arrivals=self.arrivals)
        return end, done


def simulate(m: Model, policy: str, threshold: float, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    systems = [[g * 1_000_003 % 150_000 + i for i in range(m.system)] for g in range(m.groups)]
    hashes = [page_hashes(s, m.page_size) for s in systems]
    work = [(g, systems[g] + [rng.randrange(1 << 30) for _ in range(m.question)])
            for g in range(m.groups) for _ in range(m.per_group)]
    rng.shuffle(work)
    engines = [Engine(m) for _ in range(m.engines)]
    views = [[EngineView(f"engine-{i}:1", page_size=m.page_size, up=True)
              for i in range(m.engines)] for _ in range(m.gateways)]
    routers = [Router(policy, threshold) for _ in range(m.gateways)]
    client_gateway = [rng.randrange(m.gateways) for _ in range(m.clients)]
    queues = [deque(work[c::m.clients]) for c in range(m.clients)]
    events: list[tuple[float, int, str, int, int]] = []
    order = iter(range(1 << 62))

    def push(t: float, kind: str, a: int, b: int = 0) -> None:
        heapq.heappush(events, (t, next(order), kind, a, b))

    def submit(client: int, t: float) -> None:
        if not queues[client]:
            return
        group, ids = queues[client].popleft()
        gw = client_gateway[client]
        view = routers[gw].pick(views[gw], ids, now=t).view
        e = int(view.address.split("-")[1].split(":")[0])
        engine = engines[e]
        engine.arrivals += 1
        engine.waiting.append(Req(group, ids, client, t))
        if not engine.stepping:
            engine.stepping = True
            push(t, "step", e)

    for c in range(m.clients):
        for _ in range(m.concurrency // m.clients):
            submit(c, 0.0)
    for gw in range(m.gateways):
        for e in range(m.engines):
            push(m.report_s * (gw + 1) / m.gateways, "report", gw, e)
    finished: list[Req] = []
    while events and len(finished) < len(work):
        t, _, kind, a, b = heapq.heappop(events)
        if kind == "step":
            engine = engines[a]
            if not (engine.waiting or engine.running):
                engine.stepping = False
                continue
            end, done = engine.step(t)
            for group, cached in engine.changes:
                for gw_views in views:
                    index = gw_views[a].index
                    (index.update if cached else index.difference_update)(hashes[group])
            engine.changes.clear()
            finished += done
            for r in done:
                push(end, "submit", r.client)
            push(end, "step", a)
        elif kind == "submit":
            submit(a, t)
        else:  # a load report of engine b to gateway a
            views[a][b].apply(scheduler_pb2.WatchResponse(load=engines[b].report), t)
            push(t + m.report_s, "report", a, b)
    ttfts = sorted(r.ttft for r in finished)

    def pct(q: float) -> float:
        return round(ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))], 3)

    slow = [r for r in finished if r.ttft >= pct(0.99)]
    return {
        "policy": policy, "threshold": threshold, "seed": seed, "requests": len(finished),
        "hit_rate": round(sum(e.hit_tokens for e in engines)
                          / max(1, sum(e.query_tokens for e in engines)), 3),
        "ttft_p50_s": pct(0.5), "ttft_p90_s": pct(0.9), "ttft_p99_s": pct(0.99),
        "engine_requests": [e.arrivals for e in engines],
        "engine_max_waiting": [e.max_waiting for e in engines],
        # the slowest 1 %: when they arrived (0: the opening burst) and how many were hits
        "p99_tail_arrivals_s": sorted({round(r.arrive, 1) for r in slow}),
        "p99_tail_hits": sum(r.hit for r in slow), "p99_tail": len(slow),
    }


def main(argv: list[str] | None = None) -> int:
    d = Model()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="1,2,3,4")
    p.add_argument("--policies", default="round_robin,least_load,cache_aware")
    p.add_argument("--thresholds", default="8", help="--routing-balance-threshold values")
    for name in ("groups", "per_group", "system", "question", "output", "engines", "slots",
                 "pages", "budget", "gateways", "clients", "concurrency"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    args = p.parse_args(argv)
    m = Model(**{k: getattr(args, k) for k in (
        "groups", "per_group", "system", "question", "output", "engines", "slots", "pages",
        "budget", "gateways", "clients", "concurrency")})
    for seed in (int(s) for s in args.seeds.split(",") if s):
        for policy in (x for x in args.policies.split(",") if x):
            for th in (float(x) for x in args.thresholds.split(",") if x):
                print(json.dumps(simulate(m, policy, th, seed)), flush=True)
                if policy == "round_robin":
                    break  # the threshold does not apply
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
