"""bench.peer.compare: rows matched across engines and formats, ratios ours/vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.peer.compare import collect, table

ROOT = Path(__file__).resolve().parents[2]

LINES = [
    # ours: bench.offline (fp8_e4m3 KV) and an old line without bench/engine keys
    {"bench": "offline", "engine": "minisgl", "model": "q8", "tp": 1,
     "kv_cache_dtype": "fp8_e4m3", "quantization": "fp8", "output_tok_s": 10500.0},
    {"model": "q06", "tp": 1, "kv_cache_dtype": "auto", "quantization": "none",
     "input_tokens": 1, "output_tok_s": 19000.0},
    # the peer: fp8 KV named "fp8"; an old peer line (engine, no bench)
    {"bench": "offline", "engine": "vllm", "model": "q8", "tp": 1, "kv_cache_dtype": "fp8",
     "quantization": "fp8", "output_tok_s": 10000.0},
    {"engine": "vllm", "model": "q06", "tp": 1, "kv_cache_dtype": "auto",
     "quantization": "none", "input_tokens": 1, "output_tok_s": 20000.0},
    # serving: same workload, protocol and concurrency; our gRPC line has no peer
    {"bench": "serving", "engine": "minisgl", "model": "q06", "workload": "random",
     "protocol": "http", "concurrency": 256, "output_tok_s": 18000.0, "ttft_p50_ms": 300.0},
    {"bench": "serving", "engine": "minisgl", "model": "q06", "workload": "random",
     "protocol": "grpc", "concurrency": 256, "output_tok_s": 18500.0},
    {"bench": "serving", "engine": "vllm", "model": "q06", "tp": 1, "workload": "random",
     "protocol": "http", "concurrency": 256, "output_tok_s": 16000.0, "ttft_p50_ms": 400.0},
    # prefill: matched per case
    {"bench": "prefill", "engine": "minisgl", "model": "Qwen3-8B", "case": "8x8192",
     "prefill_tok_s": 40000.0},
    {"bench": "prefill", "engine": "vllm", "model": "Qwen3-8B", "case": "8x8192",
     "prefill_tok_s": 50000.0},
    {"bench": "prefill", "engine": "vllm", "model": "Qwen3-8B", "case": "1x32768",
     "prefill_tok_s": 30000.0},
    # profile: kernel seconds by kind, read inside by_kind_s
    {"bench": "profile", "engine": "minisgl", "model": "q8", "workload": "offline",
     "gpu_busy_s": 17.0, "by_kind_s": {"attention": 6.0, "gemm": 9.0}},
    {"bench": "profile", "engine": "vllm", "model": "q8", "workload": "offline",
     "gpu_busy_s": 17.5, "by_kind_s": {"attention": 5.0, "gemm": 10.0}},
]


def _rows() -> dict[str, list[str]]:
    lines = table(collect(json.dumps(x) for x in LINES))
    assert lines[0] == "| row | metric | minisgl | vLLM | ours/vLLM |"
    return {" / ".join(c.strip() for c in line.strip("|").split("|")[:2]):
            [c.strip() for c in line.strip("|").split("|")[2:]] for line in lines[2:]}


def test_ratios() -> None:
    rows = _rows()
    assert rows["offline q8 tp=1 kv=fp8 w=fp8 / output_tok_s"] == ["10,500.0", "10,000.0",
                                                                   "1.050"]
    assert rows["offline q06 tp=1 kv=auto w=none / output_tok_s"][2] == "0.950"
    serving = "serving q06 tp=1 kv=auto w=none random http c=256"
    assert rows[f"{serving} / output_tok_s"][2] == "1.125"
    assert rows[f"{serving} / ttft_p50_ms (lower is better)"][2] == "0.750"
    assert rows["serving q06 tp=1 kv=auto w=none random grpc c=256 / output_tok_s"] == \
        ["18,500.0", "—", "—"]
    assert rows["prefill Qwen3-8B tp=1 kv=auto w=none 8x8192 / prefill_tok_s"][2] == "0.800"
    assert rows["prefill Qwen3-8B tp=1 kv=auto w=none 1x32768 / prefill_tok_s"][:2] == \
        ["—", "30,000.0"]
    prof = "profile q8 tp=1 kv=auto w=none offline"
    assert rows[f"{prof} / by_kind_s.attention (lower is better)"] == ["6", "5", "1.200"]
    assert rows[f"{prof} / by_kind_s.gemm (lower is better)"][2] == "0.900"
    assert f"{prof} / by_kind_s.norm (lower is better)" not in rows  # neither engine has it


def test_cli_reads_files(tmp_path: Path) -> None:
    path = tmp_path / "all.jsonl"
    path.write_text("not json\n" + "".join(json.dumps(x) + "\n" for x in LINES))
    out = subprocess.run([sys.executable, "-m", "bench.peer.compare", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "| offline q8 tp=1 kv=fp8 w=fp8 | output_tok_s | 10,500.0 | 10,000.0 | 1.050 |" in out
