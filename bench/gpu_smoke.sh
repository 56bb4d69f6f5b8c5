#!/usr/bin/env bash
# First GPU pass: a short offline run per attention backend, kernels against references.
# Run on the device machine from the repo root; results land in $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu_env.sh
log() { echo "=== $* ($(date +%T))"; }
log env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, grpc, google.protobuf as pb; print('torch', torch.__version__, 'triton', triton.__version__, 'grpc', grpc.__version__, 'protobuf', pb.__version__)"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
python3 -m bench.common.model_dir models/configs/Qwen3-0.6B /tmp/q06 >/dev/null
log offline 64 seqs Qwen3-0.6B flashinfer
timeout 150 python3 -m bench.offline --model /tmp/q06 --attention-backend flashinfer --num-seqs 64 --json "$OUT/offline.jsonl" 2>&1 | tail -12
log attention check
timeout 150 env PYTHONPATH="tests:$PYTHONPATH" python3 -m gpu.test_attention --backends triton,flashinfer,fa3 --page-sizes 16 --json "$OUT/attn.json" 2>&1 | tail -40
log moe check
timeout 80 env PYTHONPATH="tests:$PYTHONPATH" python3 -m gpu.test_moe --tokens 1 64 1024 4096 --iters 30 --json "$OUT/moe.json" 2>&1 | tail -15
log offline 64 seqs Qwen3-0.6B triton
timeout 100 python3 -m bench.offline --model /tmp/q06 --attention-backend triton --num-seqs 64 --json "$OUT/offline.jsonl" 2>&1 | tail -12
tar czf "$OUT/fi-cache.tgz" -C /tmp fi-cache 2>/dev/null; ls -la "$OUT"
