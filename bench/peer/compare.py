"""Ours against the peer: reads JSON lines of both (any bench.* and bench.peer.* output, in any
files) and prints a markdown table a row per workload and metric: minisgl, vLLM, ours/vLLM.

    python -m bench.peer.compare $OUT/*.jsonl

Lines are matched on the benchmark, the model folder's name, TP, KV and weight formats, and per
benchmark the workload (serving: workload, protocol, concurrency; prefill: the case). A line
without `engine` is ours; one without `bench` is classified by its keys (older lines). Where
several lines share a row, the last one counts. For time metrics (marked "lower is better") a
ratio below 1 is ours ahead.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any

from bench.profile.kernels import KINDS

HIGHER, LOWER = "", " (lower is better)"
METRICS: dict[str, list[tuple[str, str]]] = {
    "offline": [("output_tok_s", HIGHER)],
    "latency": [("decode_tok_s_bs1", HIGHER), ("ttft_ms_1k", LOWER)],
    "serving": [("output_tok_s", HIGHER), ("ttft_p50_ms", LOWER), ("ttft_p99_ms", LOWER),
                ("itl_p50_ms", LOWER), ("itl_p99_ms", LOWER), ("hit_rate", HIGHER)],
    "prefill": [("prefill_tok_s", HIGHER), ("tflops", HIGHER), ("pct_of_peak", HIGHER)],
    # bench.profile.steps / bench.peer.profile: kernel seconds by kind (a dotted metric reads
    # inside the record's `by_kind_s`).
    "profile": [("output_tok_s", HIGHER), ("gpu_busy_s", LOWER), ("gpu_idle_pct", LOWER),
                *((f"by_kind_s.{kind}", LOWER) for kind in KINDS)],
}
ENGINES = ("minisgl", "vllm")


def bench_of(rec: dict[str, Any]) -> str | None:
    if "bench" in rec:
        return str(rec["bench"])
    if "decode_tok_s_bs1" in rec:
        return "latency"
    if "case" in rec and "prefill_tok_s" in rec:
        return "prefill"
    if "concurrency" in rec and "output_tok_s" in rec:
        return "serving"
    if "input_tokens" in rec and "output_tok_s" in rec:
        return "offline"
    return None


def row_key(rec: dict[str, Any]) -> tuple[str, ...] | None:
    bench = bench_of(rec)
    if bench not in METRICS:
        return None
    kv = "fp8" if str(rec.get("kv_cache_dtype", "auto")).startswith("fp8") else "auto"
    key = [bench, str(rec.get("model", "?")), f"tp={rec.get('tp', 1)}", f"kv={kv}",
           f"w={rec.get('quantization', 'none')}"]
    if bench == "serving":
        key += [str(rec.get("workload")), str(rec.get("protocol", "http")),
                f"c={rec.get('concurrency')}"]
    elif bench == "prefill":
        key.append(str(rec.get("case")))
    elif bench == "profile":
        key.append(str(rec.get("workload", "steady")))
    return tuple(key)


def collect(lines: Iterable[str]) -> dict[tuple[str, ...], dict[str, dict[str, Any]]]:
    """row key -> engine -> the last record of that engine on that row."""
    rows: dict[tuple[str, ...], dict[str, dict[str, Any]]] = {}
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        key = row_key(rec)
        engine = str(rec.get("engine", "minisgl"))
        if key is None or engine not in ENGINES:
            continue
        rows.setdefault(key, {})[engine] = rec
    return rows


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    return f"{value:,.4g}" if isinstance(value, float) and abs(value) < 10 else f"{value:,}"


def _value(rec: dict[str, Any], metric: str) -> Any:
    """rec[metric], or for "a.b" rec[a][b]; None where missing."""
    value: Any = rec
    for part in metric.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def table(rows: dict[tuple[str, ...], dict[str, dict[str, Any]]]) -> list[str]:
    out = ["| row | metric | minisgl | vLLM | ours/vLLM |", "|---|---|---|---|---|"]
    for key, by_engine in rows.items():
        for metric, direction in METRICS[key[0]]:
            ours = _value(by_engine.get("minisgl", {}), metric)
            peer = _value(by_engine.get("vllm", {}), metric)
            if ours is None and peer is None:
                continue
            ratio = f"{ours / peer:.3f}" if ours is not None and peer else "—"
            out.append(f"| {' '.join(key)} | {metric}{direction} | {_fmt(ours)} | "
                       f"{_fmt(peer)} | {ratio} |")
    return out


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        sys.stderr.write("usage: python -m bench.peer.compare FILE.jsonl...\n")
        return 2
    lines: list[str] = []
    for path in paths:
        with open(path) as f:
            lines += f.readlines()
    print("\n".join(table(collect(lines))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
