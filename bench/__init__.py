"""Benchmarks, run as modules from the repository root on the installed packages.

    python -m bench.offline   # nano-vllm's offline workload through `LLM` (tok/s, % of roofline)
    python -m bench.latency   # bs=1: TTFT of a 1k prompt and decode tok/s
    python -m bench.serving   # the five-service stack under load (tok/s, TTFT, ITL, stack ratio)
    python -m bench.prefill   # long prompts through `LLM`: prefill tok/s, TFLOP/s against the peak
    python -m bench.peer.X    # vLLM on the same workloads (offline, latency, serving, prefill, compare)

Rooms: `bench.micro` (one kernel or one service in isolation), `bench.profile` (where a run's
time goes), `bench.common` (helpers: model dirs, roofline, clients, timing, plots). The GPU
correctness checks are pytest tests in tests/gpu (`make test-gpu`). docs/benchmarks.md has the
method, the current figures and how to reproduce each.
"""
