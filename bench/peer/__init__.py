"""The peer: vLLM run on exactly the project's benchmark workloads, in the same device call.

Each module imports the workload generator and warm-up of the matching `bench.*` module (never a
copy), so both engines see identical requests by construction, and prints one JSON line with that
module's keys plus `"engine": "vllm"`. `bench.peer.compare` tabulates ours against the peer's.

vLLM is not a dependency of the project: `--vllm-site PATH` (default $PEER_VSITE or /tmp/vsite)
names a folder holding an unpacked vLLM (see docs/benchmarks.md, "Peer (vLLM) in the same call").
"""
