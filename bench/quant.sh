#!/usr/bin/env bash
# Pre-quantized checkpoints (issue #50) on the GPU machine: kernel checks and sweeps, synthetic
# checkpoints at real shapes, then ours and vLLM's offline workload and bs=1 decode on the SAME
# folder (vLLM: --load-format safetensors, its own kernels for the format).
#
#   bash bench/quant.sh check                           # tests/gpu for each format (--json)
#   bash bench/quant.sh sweep                           # the kernels' tile sweeps
#   bash bench/quant.sh write Qwen3-8B gptq /tmp/q8-gptq   # gptq | awq | fp8 | mxfp4
#   bash bench/quant.sh ours /tmp/q8-gptq ...           # bench.offline + bench.latency
#   bash bench/quant.sh peer /tmp/q8-gptq ...           # bench.peer.offline + .latency
#
# JSON lines land in $OUT/quant.jsonl (benchmarks) and $OUT/<test>.json (checks). NO_LATENCY=1
# skips bs=1, NO_OFFLINE=1 the offline workload.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mode=${1:?usage: bench/quant.sh check|sweep|write|ours|peer ...}
shift
source bench/gpu_env.sh
export PYTHONPATH="tests:${PYTHONPATH:-}" TRITON_INTERPRET=0
GPU_TESTS="test_prequant_fp8 test_w4a16 test_moe_fp8_block test_mxfp4 test_int8"

case $mode in
  check)
    for t in $GPU_TESTS; do
      [ -f "tests/gpu/$t.py" ] || continue
      echo "=== $t ($(date +%T))"
      timeout 300 python3 "tests/gpu/$t.py" --json "$OUT/$t.json" 2>&1 | tail -25
    done
    ;;
  sweep)
    for t in test_w4a16 test_moe_fp8_block test_mxfp4; do
      [ -f "tests/gpu/$t.py" ] || continue
      echo "=== $t --sweep ($(date +%T))"
      timeout 300 python3 "tests/gpu/$t.py" --sweep --json "$OUT/$t-sweep.json" 2>&1 | tail -40
    done
    ;;
  write)
    name=${1:?config name}; fmt=${2:?format}; dir=${3:?out dir}
    case $fmt in
      gptq|awq) python3 -m bench.common.w4_dir "models/configs/$name" "$dir" "$fmt" ;;
      fp8) python3 -m bench.common.fp8_dir "models/configs/$name" "$dir" ;;
      mxfp4) python3 -m bench.common.mxfp4_dir "models/configs/$name" "$dir" ;;
      *) echo "unknown format $fmt"; exit 2 ;;
    esac
    ;;
  ours)
    for dir in "$@"; do
      if [ -z "${NO_OFFLINE:-}" ]; then
        echo "=== ours $dir offline ($(date +%T))"
        timeout 400 python3 -m bench.offline --model "$dir" --load-format safetensors \
          --json "$OUT/quant.jsonl" 2>&1 | grep -v "^Writing" | tail -4
      fi
      if [ -z "${NO_LATENCY:-}" ]; then
        echo "=== ours $dir bs=1 ($(date +%T))"
        timeout 300 python3 -m bench.latency --model "$dir" --load-format safetensors \
          --repeats 3 --json "$OUT/quant.jsonl" 2>&1 | tail -2
      fi
    done
    ;;
  peer)
    for dir in "$@"; do
      if [ -z "${NO_OFFLINE:-}" ]; then
        echo "=== vllm $dir offline ($(date +%T))"
        timeout 400 python3 -m bench.peer.offline --model "$dir" --load-format safetensors \
          --json "$OUT/quant.jsonl" 2>&1 | tail -3
      fi
      if [ -z "${NO_LATENCY:-}" ]; then
        echo "=== vllm $dir bs=1 ($(date +%T))"
        timeout 300 python3 -m bench.peer.latency --model "$dir" --load-format safetensors \
          --repeats 3 --json "$OUT/quant.jsonl" 2>&1 | tail -2
      fi
    done
    ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
