#!/usr/bin/env bash
# The architectures of issue #49 on the GPU machine, with dummy weights at their real shapes
# (models/configs/): correctness first, then the offline workload and bs=1 decode, ours and vLLM's.
#
#   bash bench/archs.sh check                      # kernels and engine against references
#   bash bench/archs.sh ours gemma-3-12b-it ...    # bench.offline + bench.latency, minisgl
#   bash bench/archs.sh peer gemma-3-12b-it ...    # bench.peer.offline, vLLM (.peer installed)
#
# JSON lines land in $OUT/archs.jsonl; `check` also writes $OUT/engine.json and $OUT/mla.json.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mode=${1:?usage: bench/archs.sh check|ours|peer [CONFIG...]}
shift
source bench/gpu_env.sh
export PYTHONPATH="tests:${PYTHONPATH:-}" TRITON_INTERPRET=0

case $mode in
  check)
    timeout 240 python3 -m gpu.test_engine check .device/fixtures-49 --backends auto \
      --json "$OUT/engine.json" 2>&1 | grep -v "^Writing" | tail -25
    timeout 150 python3 -m gpu.test_mla --sweep --json "$OUT/mla.json" 2>&1 | tail -c 3000
    timeout 200 python3 -m pytest -q -x tests/gpu/test_attention.py -k windows_and_sinks \
      tests/gpu/test_gpt_oss.py 2>&1 | tail -4
    ;;
  ours)
    for name in "$@"; do
      python3 -m bench.common.model_dir "models/configs/$name" "/tmp/$name" >/dev/null
      echo "=== ours $name offline ($(date +%T))"
      timeout 300 python3 -m bench.offline --model "/tmp/$name" --json "$OUT/archs.jsonl" \
        2>&1 | tail -3
      echo "=== ours $name bs=1 ($(date +%T))"
      [ -n "${NO_LATENCY:-}" ] || timeout 200 python3 -m bench.latency --model "/tmp/$name" --repeats 3 \
        --json "$OUT/archs.jsonl" 2>&1 | tail -2
    done
    ;;
  peer)
    for name in "$@"; do
      python3 -m bench.common.model_dir "models/configs/$name" "/tmp/$name" >/dev/null
      echo "=== vllm $name offline ($(date +%T))"
      timeout 300 python3 -m bench.peer.offline --model "/tmp/$name" --json "$OUT/archs.jsonl" \
        2>&1 | tail -3
    done
    ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
