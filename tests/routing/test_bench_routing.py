"""bench/routing.py end to end on CPU with the tiny model: it launches two engines, runs the
shared-prefix workload through a cache-aware gateway (with a flag of its own) and reports a JSON
line with numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_routing_cpu_smoke(tiny_model_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.routing", "--device", "cpu", "--model",
         str(tiny_model_path), "--load-format", "auto", "--engines", "2", "--modes", "routed",
         "--policies", "cache_aware:--routing-queue-slack=-1", "--num-groups", "3",
         "--prompts-per-group", "3",
         "--system-prompt-len", "64", "--question-len", "8", "--output-len", "3",
         "--gateway-replicas", "1", "--client-processes", "1", "--concurrency", "4",
         "--repeats", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    *records, summary = lines
    assert len(records) == 2 and all(r["mode"] == "routed" for r in records)
    rec = records[0]
    assert rec["mode"] == "routed" and rec["policy"] == "cache_aware" and rec["errors"] == 0
    assert rec["requests"] == 9 and rec["output_tok_s"] > 0 and rec["ttft_p99_s"] > 0
    # 3 groups x 3 prompts: at least the later prompts of each group find their prefix.
    assert rec["hit_rate"] > 0.3
    # Per engine, from its metrics and its polled load: the two engines finished the 9 requests,
    # each queue-time quantile is a histogram bucket bound, the load was seen at least running.
    assert len(rec["engine_requests"]) == 2 and sum(rec["engine_requests"]) == 9
    assert all(isinstance(q, float) for q in rec["engine_queue_p99_s"] if q is not None)
    assert len(rec["engine_max_waiting"]) == 2 and rec["engine_preemptions"] == [0, 0]
    # 9 requests, 4 in flight: 5 went out after the opening burst.
    assert 0 < rec["ttft_after_burst_p50_s"] <= rec["ttft_after_burst_p99_s"]
    # A policy's own flags reach its gateways (which would refuse an unknown flag).
    assert rec["gateway_args"] == "--routing-queue-slack=-1"
    # Both rounds of the one variant, summarized (no single engine ran: no ratio).
    (variant, row), = summary["summary"].items()
    assert variant == "cache_aware --routing-queue-slack=-1" and row["runs"] == 2
    assert "x_single" not in row and row["ttft_p99_s"] > 0


def test_summary_takes_means_and_medians_per_variant() -> None:
    from bench.routing import summarize

    def run(mode: str, policy: str, args: str, tok_s: float, p99: float) -> dict[str, object]:
        return {"mode": mode, "policy": policy, "gateway_args": args, "output_tok_s": tok_s,
                "hit_rate": 0.5, "ttft_p50_s": 0.1, "ttft_p99_s": p99}

    out = summarize([run("routed", "cache_aware", "", 30.0, 1.0),
                     run("routed", "cache_aware", "--x=1", 20.0, 9.0),
                     run("routed", "cache_aware", "", 20.0, 3.0),
                     run("routed", "cache_aware", "", 40.0, 2.0),
                     run("single", "round_robin", "", 10.0, 5.0)])
    assert out["cache_aware"] == {"runs": 3, "output_tok_s": 30.0, "hit_rate": 0.5,
                                  "ttft_p50_s": 0.1, "ttft_p99_s": 2.0, "x_single": 3.0}
    assert out["cache_aware --x=1"]["runs"] == 1 and out["cache_aware --x=1"]["x_single"] == 2.0
