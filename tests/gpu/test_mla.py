"""GPU check of the MLA Triton kernels (kernels/mla_attention.py) at DeepSeek's shapes (16 heads a
rank, latent 512 + rotary 64, bf16): accuracy against an fp32 reference, and decode speed at
batch 256 as bytes of latent cache read per second against the device's copy bandwidth.

    PYTHONPATH=tests:$PYTHONPATH python3 -m gpu.test_mla [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

V, R, H, PS = 512, 64, 16, 16
DEV = torch.device("cuda")


def _case(lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    pages = [-(-n // PS) for n in lens]
    cache = torch.randn(sum(pages) + 1, PS, 1, V + R, device=DEV, generator=gen,
                        dtype=torch.bfloat16)
    order = torch.randperm(sum(pages), device=DEV, generator=gen).to(torch.int32)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=DEV)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[used:used + n]
        used += n
    return cache, table, torch.tensor(lens, dtype=torch.int32, device=DEV)


def _reference(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, b: int, n: int,
               prefix: int, scale: float) -> torch.Tensor:
    t = torch.arange(prefix + n, device=DEV)
    kv = cache[table[b].long()[t // PS], t % PS, 0].float()
    s = torch.einsum("qhd,kd->hqk", q.float(), kv) * scale
    q_pos = prefix + torch.arange(n, device=DEV)[:, None]
    s = s.masked_fill(t[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,kd->qhd", s.softmax(-1), kv[:, :V])


def run(json_path: str | None = None, sweep: bool = False) -> dict:
    from minisgl_worker.kernels.mla_attention import mla_decode, mla_extend
    from minisgl_worker.kernels.paged_decode import choose_num_splits

    from bench.common.roofline import measure_hbm_bandwidth

    scale = 192 ** -0.5
    out: dict = {}
    lens = [1, 700, 33, 4096, 129]
    cache, table, seq = _case(lens, 0)
    q = torch.randn(len(lens), H, V + R, device=DEV, dtype=torch.bfloat16)
    rows = torch.arange(len(lens), dtype=torch.int32, device=DEV)
    for splits in (1, 8):
        got = mla_decode(q, cache, V, table, rows, seq, scale, splits).float()
        err = max(((got[b] - _reference(q[b:b + 1], cache, table, b, 1, n - 1, scale)[0]).norm()
                   / _reference(q[b:b + 1], cache, table, b, 1, n - 1, scale)[0].norm()).item()
                  for b, n in enumerate(lens))
        out[f"decode_splits{splits}_rel_err"] = err
    reqs = [(0, 300), (500, 77), (0, 1)]
    cache, table, _ = _case([p + n for p, n in reqs], 1)
    new = [n for _, n in reqs]
    q = torch.randn(sum(new), H, V + R, device=DEV, dtype=torch.bfloat16)
    cu = torch.tensor([0] + new, device=DEV).cumsum(0).to(torch.int32)
    prefix = torch.tensor([p for p, _ in reqs], dtype=torch.int32, device=DEV)
    got = mla_extend(q, cache, V, table, torch.arange(3, dtype=torch.int32, device=DEV), cu,
                     prefix, max(new), scale).float()
    out["extend_rel_err"] = max(
        ((got[cu[b]:cu[b + 1]] - (ref := _reference(q[cu[b]:cu[b + 1]], cache, table, b, n, p,
                                                     scale))).norm() / ref.norm()).item()
        for b, (p, n) in enumerate(reqs))
    # speed: batch 256, contexts ~1k (the offline workload's average decode context)
    gen = torch.Generator().manual_seed(2)
    lens = torch.randint(600, 1400, (256,), generator=gen).tolist()
    cache, table, seq = _case(lens, 3)
    q = torch.randn(256, H, V + R, device=DEV, dtype=torch.bfloat16)
    rows = torch.arange(256, dtype=torch.int32, device=DEV)
    splits = choose_num_splits(256, 1, 4096)
    for _ in range(3):
        mla_decode(q, cache, V, table, rows, seq, scale, splits)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        mla_decode(q, cache, V, table, rows, seq, scale, splits)
    end.record()
    end.synchronize()
    sec = start.elapsed_time(end) / 1000 / 20
    read = sum(lens) * (V + R) * 2
    copy = measure_hbm_bandwidth()
    out.update(decode_bs256_us=sec * 1e6, decode_bs256_tbps=read / sec / 1e12,
               copy_tbps=copy / 1e12, decode_pct_of_copy=100 * read / sec / copy,
               splits=splits)
    if sweep:  # launch settings of the decode kernel at batch 256
        out["sweep"] = {}
        for bn in (32, 64):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    for sp in sorted({1, 2, splits}):
                        def call(sp: int = sp, bn: int = bn, warps: int = warps,
                                 stages: int = stages) -> None:
                            mla_decode(q, cache, V, table, rows, seq, scale, sp, block_n=bn,
                                       num_warps=warps, num_stages=stages)
                        try:
                            for _ in range(2):
                                call()
                            start.record()
                            for _ in range(10):
                                call()
                            end.record()
                            end.synchronize()
                            t = start.elapsed_time(end) / 10 / 1000
                            out["sweep"][f"n{bn}-w{warps}-s{stages}-sp{sp}"] = round(
                                100 * read / t / copy, 1)
                        except Exception as exc:  # a config that does not fit
                            out["sweep"][f"n{bn}-w{warps}-s{stages}-sp{sp}"] = str(exc)[:40]
    out["ok"] = max(out["decode_splits1_rel_err"], out["decode_splits8_rel_err"],
                    out["extend_rel_err"]) < 2e-2
    print(json.dumps(out))
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))
    return out


def test_mla_kernels_on_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert run()["ok"]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--sweep", action="store_true", help="time the decode kernel's settings")
    a = p.parse_args()
    sys.exit(0 if run(a.json, a.sweep)["ok"] else 1)
