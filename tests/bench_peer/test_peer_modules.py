"""bench.peer on CPU, against a fake vLLM site (fake_vllm.py): each peer module sends exactly the
requests of the matching bench.* module (imported, not copied), in an environment with NVLink
multicast off; the server command carries the flags a token-id, tokenizer-less run needs; a site
without vLLM ends with a message, not a traceback."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bench.latency
import bench.offline
import bench.peer.latency
import bench.peer.offline
import bench.peer.prefill
import bench.peer.serving
import bench.prefill
import bench.profile.kernels
import bench.profile.steps
import bench.serving
from bench.peer.server import flags
from bench.peer.vllm_env import NVLS_OFF, child_env, flashinfer_visible
from tests.bench_peer.fake_vllm import make_site

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny"


def _peer(module: str, site: Path, log: Path, *args: str,
          pythonpath: str | None = None) -> tuple[list[dict], list[dict]]:
    """Runs `python -m module` on the fake site: (its JSON lines, what the fake LLM saw)."""
    env = {**os.environ, "FAKE_VLLM_LOG": str(log)}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    for key in NVLS_OFF:  # the module itself must set them for vLLM
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", module, "--vllm-site", str(site),
                           "--model", str(TINY), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return out, [json.loads(x) for x in log.read_text().splitlines()]


@pytest.fixture
def site(tmp_path: Path) -> Path:
    return make_site(tmp_path / "site")


def test_generators_are_ours_not_copies() -> None:
    assert bench.peer.offline.workload is bench.offline.workload
    assert bench.peer.offline.warm_up_requests is bench.offline.warm_up_requests
    assert bench.peer.latency.latency_prompt is bench.latency.latency_prompt
    assert bench.peer.serving.build_workload is bench.serving.build_workload
    assert bench.peer.serving.run_load is bench.serving.run_load
    assert bench.peer.prefill.case_prompts is bench.prefill.case_prompts


def test_offline_sends_our_workload_and_warm_up(site: Path, tmp_path: Path) -> None:
    (rec,), seen = _peer("bench.peer.offline", site, tmp_path / "log", "--num-seqs", "6",
                         "--kv-cache-dtype", "fp8", "--tp", "2")
    init, warm, timed = seen
    assert init["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(site.resolve())
    assert {k: init["env"][k] for k in NVLS_OFF} == NVLS_OFF
    assert init["env"]["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    kw = init["init"]
    assert (kw["load_format"], kw["skip_tokenizer_init"], kw["enable_prefix_caching"],
            kw["max_num_seqs"], kw["tensor_parallel_size"], kw["kv_cache_dtype"]) == \
        ("dummy", True, True, 256, 2, "fp8")
    assert (warm["prompts"], warm["max_tokens"]) == tuple(map(list,
                                                             bench.offline.warm_up_requests()))
    prompts, outs = bench.offline.workload(6)
    assert (timed["prompts"], timed["max_tokens"]) == (prompts, outs)
    assert rec["bench"] == "offline" and rec["engine"] == "vllm" and rec["tp"] == 2
    assert rec["input_tokens"] == sum(map(len, prompts))
    assert rec["output_tokens"] == sum(outs) and rec["output_tok_s"] > 0


def test_latency_sends_our_prompt_without_prefix_cache(site: Path, tmp_path: Path) -> None:
    (rec,), seen = _peer("bench.peer.latency", site, tmp_path / "log", "--prompt-len", "32",
                         "--decode-tokens", "8", "--repeats", "2")
    init, *calls = seen
    assert init["init"]["enable_prefix_caching"] is False  # ours runs cache="naive"
    assert all(c["prompts"] == [bench.latency.latency_prompt(32)] for c in calls)
    assert [c["max_tokens"] for c in calls] == [[4], [1], [8], [1], [8]]
    assert rec["bench"] == "latency" and rec["decode_tok_s_bs1"] > 0


def test_prefill_sends_our_cases(site: Path, tmp_path: Path) -> None:
    recs, seen = _peer("bench.peer.prefill", site, tmp_path / "log", "--cases", "2x40,1x64",
                       "--repeats", "1", "--max-num-batched-tokens", "512")
    init, *calls = seen
    assert init["init"]["max_num_batched_tokens"] == 512
    cases = bench.prefill.parse_cases("2x40,1x64")
    vocab = json.loads((TINY / "config.json").read_text())["vocab_size"]
    expected = [bench.prefill.case_prompts(c, r, vocab) for r in (-1, 0) for c in cases]
    assert [c["prompts"] for c in calls] == expected
    assert all(c["max_tokens"] == [1] * len(c["prompts"]) for c in calls)
    assert [(r["case"], r["prompt_tokens"], r["max_num_batched_tokens"]) for r in recs] == \
        [("2x40", 80, 512), ("1x64", 64, 512)]


def test_serving_command_and_env(site: Path) -> None:
    args = bench.peer.serving.parse_args(["--model", str(TINY), "--tp", "2", "--port", "8123",
                                          "--kv-cache-dtype", "fp8", "--quantization", "fp8",
                                          "--workload", "offline"])
    assert args.workload == "random"  # bench.serving's name for the offline workload's requests
    server = bench.peer.serving.make_server(args, site)
    cmd = server.command
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    pairs = {(a, b) for a, b in zip(cmd, cmd[1:], strict=False)}
    for pair in [("--port", "8123"), ("--model", str(TINY.resolve())), ("--load-format", "dummy"),
                 ("--max-num-seqs", "256"), ("--tensor-parallel-size", "2"),
                 ("--kv-cache-dtype", "fp8"), ("--quantization", "fp8"),
                 ("--generation-config", "vllm"), ("--host", "127.0.0.1")]:
        assert pair in pairs, pair
    assert "--skip-tokenizer-init" in cmd and "--enable-prefix-caching" in cmd
    assert server.url == "http://127.0.0.1:8123"
    assert {k: server.env[k] for k in NVLS_OFF} == NVLS_OFF
    assert server.env["PYTHONPATH"].split(os.pathsep)[0] == str(site.resolve())
    assert flags({"enforce_eager": False, "attention_config": {"backend": "FLASH_ATTN"}}) == \
        ["--no-enforce-eager", "--attention-config", '{"backend": "FLASH_ATTN"}']


def test_generated_shared_prefix_workload() -> None:
    work = bench.serving.build_workload("generated-shared-prefix", 20, vocab=4096)
    assert len(work) == 20 and {n for _, n in work} == {256}
    assert {len(p) for p, _ in work} == {2048 + 128}
    assert len({tuple(p[:2048]) for p, _ in work}) == 3  # ceil(20 / 8) system prompts
    assert max(max(p) for p, _ in work) < 4096


@pytest.mark.parametrize("module", ["bench.peer.offline", "bench.peer.serving"])
def test_missing_site_is_a_message(module: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "--vllm-site", str(tmp_path),
                           "--model", str(TINY)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "no vLLM at --vllm-site" in proc.stderr and "Traceback" not in proc.stderr


def test_serving_drives_the_server_with_our_client(site: Path, tmp_path: Path) -> None:
    """Against the fake server (empty text, token ids, as vLLM without a tokenizer streams):
    every request of bench.serving's workload and warm-up arrives once, every token is counted,
    and the hit rate comes from the /metrics counters' change over the timed load."""
    (rec,), seen = _peer("bench.peer.serving", site, tmp_path / "log", "--num-requests", "12",
                         "--concurrency", "4", "--workload", "generated-shared-prefix",
                         "--server-log", str(tmp_path / "server.log"))
    bodies = [x["body"] for x in seen]
    warm = list(zip(*bench.offline.warm_up_requests(), strict=True))
    work = bench.serving.build_workload("generated-shared-prefix", 12, vocab=4096)
    sent = sorted((b["prompt"], b["max_tokens"]) for b in bodies)
    assert sent == sorted([*warm, *work])
    assert all(b["return_token_ids"] and b["ignore_eos"] and b["stream"] for b in bodies)
    assert (rec["bench"], rec["engine"], rec["requests"], rec["errors"]) == \
        ("serving", "vllm", 12, 0)
    assert rec["workload"] == "generated-shared-prefix" and rec["protocol"] == "http"
    assert rec["output_tok_s"] > 0 and rec["ttft_p50_ms"] > 0
    assert rec["itl_p50_ms"] is not None
    assert rec["hit_rate"] == 0.5  # the fake counts half of each timed prompt (2,176 ids) a hit


def test_profile_sends_the_steady_batch_in_process(site: Path, tmp_path: Path) -> None:
    """bench.peer.profile: vLLM's engine core in this process (else the profiler sees no kernel),
    the same requests as bench.profile.steps, the same fields as ours."""
    (rec,), seen = _peer("bench.peer.profile", site, tmp_path / "log", "--batch", "3",
                         "--prompt-len", "5", "--output-len", "2", "--rows", "3")
    init, warm, timed = seen
    assert init["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert init["init"]["enable_prefix_caching"] is False  # ours runs the steady batch uncached
    vocab = json.loads((TINY / "config.json").read_text())["vocab_size"]
    args = argparse.Namespace(workload="steady", batch=3, prompt_len=5, output_len=2)
    (_, _), (prompts, lens) = bench.profile.steps.requests(args, vocab)
    assert warm["prompts"] == timed["prompts"] == prompts and timed["max_tokens"] == lens == [2] * 3
    assert (rec["bench"], rec["engine"], rec["workload"], rec["batch"]) == \
        ("profile", "vllm", "steady", 3)
    assert set(rec["by_kind_s"]) == set(bench.profile.kernels.KINDS)
    assert rec["gpu_busy_s"] == 0 and rec["output_tok_s"] > 0  # the fake runs no kernel


def test_vllm_never_sees_our_flashinfer(site: Path, tmp_path: Path) -> None:
    """bench/gpu_env.sh puts our FlashInfer (0.6.4) on PYTHONPATH; vLLM 0.26 failed to start
    with it there (it calls newer FlashInfer APIs), so every vLLM process runs without it."""
    ours = tmp_path / "site-with-flashinfer"
    (ours / "flashinfer").mkdir(parents=True)
    (ours / "flashinfer" / "__init__.py").write_text("")
    repo = str(ROOT)
    env = child_env(site.resolve(), {"PYTHONPATH": os.pathsep.join([str(ours), repo])})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(site.resolve()), repo]
    assert not flashinfer_visible(env)  # (no FlashInfer on this CPU machine's own path)
    (rec,), seen = _peer("bench.peer.offline", site, tmp_path / "log", "--num-seqs", "2",
                         pythonpath=os.pathsep.join([str(ours), repo]))
    assert str(ours) not in seen[0]["env"]["PYTHONPATH"].split(os.pathsep)
    assert rec["flashinfer_on_path"] is False
    # The OpenAI server is a child process: its line reports the server's path, not the
    # parent's (which still holds ours: the line said true on the GPU machine when it was not).
    (rec,), _ = _peer("bench.peer.serving", site, tmp_path / "log2", "--num-requests", "2",
                      "--concurrency", "2", "--server-log", str(tmp_path / "server.log"),
                      pythonpath=os.pathsep.join([str(ours), repo]))
    assert rec["flashinfer_on_path"] is False
    assert flashinfer_visible({"PYTHONPATH": str(ours)})
