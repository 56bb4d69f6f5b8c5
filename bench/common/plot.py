"""PNG plots for docs/benchmarks.md from bench.serving output (matplotlib; not a test dependency).

    pip install matplotlib
    python -m bench.common.plot --results serving.jsonl --samples samples.jsonl --out docs/img

Writes `serving_throughput.png` (output tok/s against concurrency per protocol, with the
in-process rate of the same workload as a line) and `serving_latency_cdf.png` (TTFT and ITL
CDFs per protocol and concurrency).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def read_lines(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True, help="bench.serving --json output")
    ap.add_argument("--samples", required=True, help="bench.serving --samples output")
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("bench/common/plot.py needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results, samples = read_lines(a.results), read_lines(a.samples)

    fig, ax = plt.subplots(figsize=(6, 4))
    by_proto: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in results:
        by_proto[r["protocol"]].append((r["concurrency"], r["output_tok_s"]))
    for proto, points in sorted(by_proto.items()):
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", label=f"five-service stack ({proto})")
    in_proc = [r["in_process_tok_s"] for r in results if "in_process_tok_s" in r]
    if in_proc:
        ax.axhline(max(in_proc), linestyle="--", color="gray", label="in-process LLM, all at once")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens / s")
    ax.set_title(a.title or "Throughput against concurrency", fontsize=9, wrap=True)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "serving_throughput.png", dpi=120)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for s in sorted(samples, key=lambda s: (s["protocol"], s["concurrency"])):
        label = f"{s['protocol']} c={s['concurrency']}"
        for ax, key in zip(axes, ("ttft_s", "itl_s"), strict=True):
            xs = sorted(1000 * x for x in s[key])
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    for ax, name in zip(axes, ("time to first token (ms)", "inter-token latency (ms)"),
                        strict=True):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # only decades are labelled
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(a.title or "Latency CDFs")
    fig.tight_layout()
    fig.savefig(out / "serving_latency_cdf.png", dpi=120)
    print("wrote", out / "serving_throughput.png", out / "serving_latency_cdf.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
