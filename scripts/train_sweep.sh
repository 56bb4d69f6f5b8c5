#!/usr/bin/env bash
# Train three variants of the tiny model side by side on one GPU (a 5M-parameter model leaves
# an H100 mostly idle) and keep the one with the lowest validation loss. Used for the shipped
# model through the device tool; expects .train/corpus.tsv and .train/tok/ (see MODEL_CARD.md).
#   OUT=/some/dir BUDGET=380 bash scripts/train_sweep.sh
set -euo pipefail
OUT=${OUT:?set OUT to the result directory}
BUDGET=${BUDGET:-380}
WORK=${WORK:-/tmp/tiny_sweep}
PY=${PY:-python3}
EXTRA=${EXTRA:-}  # extra flags for every variant, e.g. a tiny shape for a CPU smoke run
mkdir -p "$WORK" "$OUT/model"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
common=(--corpus .train/corpus.tsv --tokenizer-dir .train/tok --seed 1234
    --time-budget "$BUDGET")
# shellcheck disable=SC2206
extra=($EXTRA)
variant() {  # NAME FLAGS...: one training run, its output in $WORK/NAME.log
    local name=$1
    shift
    "$PY" scripts/train_tiny_model.py "${common[@]}" --out "$WORK/$name" "$@" "${extra[@]}" \
        >"$WORK/$name.log" 2>&1
}
variant a --lr 2e-3 --steps 100000 &
variant b --lr 2e-3 --steps 5000 &
variant c --lr 3e-3 --steps 2000 &
wait || true
for v in a b c; do echo "=== variant $v"; cat "$WORK/$v.log"; done | tee "$OUT/stdout.txt"
"$PY" - "$WORK" "$OUT" <<'PYEOF'
import json, shutil, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
logs = {}
for v in "abc":
    p = work / v / "train_log.json"
    if p.exists():
        logs[v] = json.loads(p.read_text())
        shutil.copyfile(p, out / f"log_{v}.json")
best = min(logs, key=lambda v: logs[v]["final"]["val_loss"])
print("best variant:", best, json.dumps(logs[best]["final"]))
for name in ("config.json", "model.safetensors", "generation_config.json"):
    shutil.copyfile(work / best / name, out / "model" / name)
(out / "model" / "variant.txt").write_text(best + "\n")
PYEOF
