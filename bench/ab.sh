#!/usr/bin/env bash
# Before/after on the GPU machine in one call: the same benchmark rows from this checkout ("after")
# and from an older tree ("before", e.g. `git archive <commit> --prefix=.before/ | tar x`, an
# ignored folder carried with the call), alternating after, before, before, after so that a drift
# of the machine over the call does not read as a difference.
#
#   bash bench/ab.sh .before offline-q06 offline-q8 latency-q8 serving-q06
#
# Rows: offline-q06 / offline-q8 (bench.offline, the nano-vllm workload), latency-q8 (bench.latency,
# bs=1), serving-q06 (bench.serving --launch, five services, 256 streams over HTTP, 2 gateways).
# JSON lines land in $OUT/ab.jsonl, each with "tree": "after" | "before".
set -u
before=${1:?usage: bench/ab.sh BEFORE_DIR ROW...}
shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
here=$(pwd)
before=$(cd "$before" && pwd)
source bench/gpu_env.sh  # installs the carried wheels into /tmp/site once, for both trees
python3 -m bench.common.model_dir models/configs/Qwen3-0.6B /tmp/q06 >/dev/null
python3 -m bench.common.model_dir models/configs/Qwen3-8B /tmp/q8 >/dev/null

row() {  # row TREE_NAME TREE_DIR ROW
  local name=$1 dir=$2 what=$3 json="/tmp/ab-$1-$3.jsonl"
  rm -f "$json"
  echo "=== $what $name ($(date +%T))"
  (
    cd "$dir" && source bench/gpu_env.sh >/dev/null
    case $what in
      offline-q06) timeout 240 python3 -m bench.offline --model /tmp/q06 --json "$json" ;;
      offline-q8) timeout 300 python3 -m bench.offline --model /tmp/q8 --json "$json" ;;
      latency-q8) timeout 240 python3 -m bench.latency --model /tmp/q8 --repeats 3 --json "$json" ;;
      serving-q06) timeout 300 python3 -m bench.serving --launch --model /tmp/q06 --concurrency 256 \
        --gateway-replicas 2 --json "$json" ;;
      *) echo "unknown row $what"; exit 2 ;;
    esac
  ) 2>&1 | tail -4
  [ -f "$json" ] && python3 -c "import json,sys; [print(json.dumps({'tree': sys.argv[1], **json.loads(l)})) for l in open(sys.argv[2]) if l.strip()]" \
    "$name" "$json" >>"$OUT/ab.jsonl"
}

for what in "$@"; do
  row after "$here" "$what"
  row before "$before" "$what"
  row before "$before" "$what"
  row after "$here" "$what"
done
python3 - "$OUT/ab.jsonl" <<'EOF'
import json, sys
keys = ("output_tok_s", "pct_of_roofline", "decode_tok_s_bs1", "ttft_ms_1k", "ttft_p50_ms", "itl_p50_ms")
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["tree"], r.get("bench"), r.get("model"), {k: r[k] for k in keys if k in r})
EOF
