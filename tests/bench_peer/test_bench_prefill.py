"""bench.prefill end to end on CPU with the tiny model: every prompt token counted, none taken
from the prefix cache, and the FLOPs of the documented formula."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.prefill import parse_cases

ROOT = Path(__file__).resolve().parents[2]


def test_prefill_on_tiny(tmp_path: Path) -> None:
    out = tmp_path / "prefill.jsonl"
    proc = subprocess.run([sys.executable, "-m", "bench.prefill", "--model", "models/tiny",
                           "--cases", "2x48,1x96", "--repeats", "2", "--max-prefill-tokens", "64",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["case"], r["prompt_tokens"], r["cached_tokens"]) for r in recs] == \
        [("2x48", 96, 0), ("1x96", 96, 0)]
    # tiny: 6 layers, hidden 256, 4 query heads and 2 KV heads of 64, MLP 704
    params = 6 * (256 * 64 * (4 + 2 * 2) + 4 * 64 * 256 + 3 * 256 * 704)
    for r, seqs, length in zip(recs, (2, 1), (48, 96), strict=True):
        assert r["gemm_flops"] == 2 * params * seqs * length
        assert r["attention_flops"] == seqs * 2 * 2 * 6 * 4 * 64 * length ** 2 // 2
        assert r["flops"] == r["gemm_flops"] + r["attention_flops"]
        assert r["max_prefill_tokens"] == 64 and r["engine"] == "minisgl"
        assert r["prefill_tok_s"] == pytest.approx(96 / r["seconds"], rel=1e-3)
        assert r["pct_of_peak"] == pytest.approx(100 * r["tflops"] / 790, abs=0.01)


def test_parse_cases() -> None:
    assert [(c.seqs, c.prompt_len, c.name) for c in parse_cases("8x8192, 1X32768")] == \
        [(8, 8192, "8x8192"), (1, 32768, "1x32768")]
    with pytest.raises(ValueError):
        parse_cases("0x10")
