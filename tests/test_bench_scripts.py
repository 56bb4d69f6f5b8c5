"""bench.offline and bench.latency run end to end on CPU (the GPU figures in
docs/benchmarks.md come from these same scripts): the nano-vllm workload's shape on a small model
with dummy weights, greedy outputs equal with overlap scheduling on and off, every requested token
produced, and the roofline fields filled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common.model_dir import make
from bench.offline import workload

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The tiny model's shape with a vocabulary that holds the workload's ids (0-10000).
    out = tmp_path_factory.mktemp("bench-model")
    config = json.loads((ROOT / "models" / "tiny" / "config.json").read_text())
    config["vocab_size"] = 16384
    (out / "config.json").write_text(json.dumps(config))
    return make(str(out), str(out))


def _run(module: str, *args: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_offline_workload_overlap_on_and_off(model_dir: Path) -> None:
    records = _run("bench.offline", "--model", str(model_dir), "--num-seqs", "4",
                   # A CPU-sized bandwidth: at 1 TB/s the floor is ~0.02 s and a slow, loaded box
                   # rounded the percentage to 0.0.
                   "--temperature", "0", "--compare-overlap", "--hbm-tbps", "0.01")
    prompts, outputs = workload(4)
    # offline.py itself asserts the two runs' greedy tokens are identical.
    assert [r["overlap"] for r in records] == [False, True]
    for r in records:
        assert r["input_tokens"] == sum(map(len, prompts))
        assert r["output_tokens"] == sum(outputs)
        assert r["output_tok_s"] > 0 and r["roofline_s"] > 0 and r["pct_of_roofline"] > 0
        assert r["max_prefill_tokens"] == 16384  # the LLM class's default, as recorded
        assert len(r["gc_passes"]) == 3 and r["gc_seconds"] >= 0


def test_latency_script(model_dir: Path) -> None:
    (record,) = _run("bench.latency", "--model", str(model_dir), "--prompt-len", "64",
                     "--decode-tokens", "16", "--repeats", "1")
    assert record["ttft_ms_1k"] > 0 and record["decode_tok_s_bs1"] > 0


def test_serving_reads_the_workers_steps_by_graph() -> None:
    """bench.serving's `worker_steps_by_graph` parses the worker's counter as Prometheus
    renders it (every label set summed by its `graph` label)."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from bench.common.step_graphs import graph_steps

    registry = CollectorRegistry()
    steps = Counter("minisgl_worker_step_graph", "steps", ("model_name", "graph"),
                    registry=registry)
    steps.labels("a", "eager").inc(3)
    steps.labels("b", "eager").inc(2)
    steps.labels("a", "piecewise").inc(7)
    steps.labels("a", "cuda_graph")
    text = generate_latest(registry).decode()
    assert graph_steps(text) == {"eager": 5.0, "piecewise": 7.0, "cuda_graph": 0.0}
