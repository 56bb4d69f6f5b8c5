"""One-GPU check and timing of the TP draw from vocabulary shards against the gathered draw.

    source bench/gpu_env.sh && python -m bench.micro.sharded_sampling [--tp 2] [--iters 200]

Qwen3's vocabulary (151,936) split as the LM head splits it over --tp ranks, bf16 logits, B in
1, 64, 256, all-greedy and temperature batches (a third of the rows greedy). Exactness (compiled
Triton, not the interpreter the CPU tests run): the per-shard bests, packed and picked as every
rank does after the exchange, give the full-vocabulary draw's tokens. Timing (CUDA graph
replays, median): one rank's local work either way, the communication left out (NCCL all-gather
of [B, V/N] logits against one of [B, 2] float64; bench.offline --tp-size N with and without
--disable-sharded-sampling measures the whole): `gathered_us` = the cat of the N shards (what
all_gather_last does after NCCL) + the cut-off view + the draw over the full vocabulary;
`sharded_us` = the draw over this rank's shard + the pack + the pick over N packs. One JSON line
per case; exit status 1 on any token mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch
from minisgl_worker.sampling import ops
from minisgl_worker.sampling.sharded import VocabShard, pack, pick_packed, shard_best

from bench.common import jsonl
from bench.common.gpu_timing import graph_replay_ms

VOCAB = 151_936


@dataclass
class Batch:
    parts: list[torch.Tensor]  # each rank's [B, local] bf16 logits (the last one padded)
    seeds: torch.Tensor
    positions: torch.Tensor
    temps: torch.Tensor | None  # None: all greedy

    def draw_full(self, x: torch.Tensor) -> torch.Tensor:
        if self.temps is None:
            return x.argmax(dim=1)
        return ops.gumbel_argmax(x, self.seeds, self.positions, None, temps=self.temps,
                                 use_triton=True)

    def best(self, rank: int, shard: VocabShard) -> torch.Tensor:
        return pack(*shard_best(self.parts[rank], shard, self.seeds, self.positions, self.temps,
                                None, True))


def run_case(b: Batch, shards: list[VocabShard], iters: int) -> dict:
    full = torch.cat(b.parts, dim=-1)[:, :VOCAB]
    want = b.draw_full(full)
    exchanged = torch.stack([b.best(r, s) for r, s in enumerate(shards)])
    same = bool(torch.equal(pick_packed(exchanged), want))

    def gathered() -> torch.Tensor:
        return b.draw_full(torch.cat(b.parts, dim=-1)[:, :VOCAB])

    def sharded() -> torch.Tensor:  # rank 0: its own pack and the others' from the exchange
        return pick_packed(torch.cat([b.best(0, shards[0])[None], exchanged[1:]]))

    return {"tokens_equal": same, "gathered_us": round(1e3 * graph_replay_ms(gathered, iters), 1),
            "sharded_us": round(1e3 * graph_replay_ms(sharded, iters), 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    local = -(-VOCAB // a.tp)
    shards = [VocabShard.of_rank(VOCAB, r, a.tp) for r in range(a.tp)]
    ok = True
    for batch in (1, 64, 256):
        wide = torch.randn(batch, local * a.tp, generator=gen, device=dev).mul_(4)
        wide = wide.to(torch.bfloat16)
        parts = [wide[:, r * local : (r + 1) * local].contiguous() for r in range(a.tp)]
        seeds = torch.randint(0, 2**62, (batch,), generator=gen, device=dev)
        positions = torch.randint(0, 2**20, (batch,), generator=gen, device=dev)
        mixed = torch.tensor([0.0, 0.6, 1.3], device=dev).repeat(batch)[:batch]
        for kind, temps in (("greedy", None), ("temperature", mixed)):
            rec = {"bench": "sharded_sampling", "tp": a.tp, "batch": batch, "kind": kind,
                   **run_case(Batch(parts, seeds, positions, temps), shards, a.iters),
                   "device": torch.cuda.get_device_name()}
            ok &= rec["tokens_equal"]
            print(json.dumps(rec), flush=True)
            jsonl.append(a.json, [rec])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
