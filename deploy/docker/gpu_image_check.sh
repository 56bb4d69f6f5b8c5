#!/usr/bin/env bash
# Run the CUDA worker image's Python environment on a GPU host without Docker, and prove it serves.
#
#   bash deploy/docker/gpu_image_check.sh OUTDIR
#
# For hosts that can build no image (the project's GPU machines have no registry and no Docker):
# it reproduces what `deploy/docker/Dockerfile --target worker-cuda` installs on top of the host's
# CUDA torch, pinned by deploy/docker/constraints-cuda.txt, and then does what the image does:
#   1. install FlashInfer, the services' wheels (from .whl/, no network) and the six packages, as
#      the image's pip does, then compare every installed version with the image's pins;
#   2. prebuild the FlashInfer kernels as the image's build step does (deploy/docker/prebuild_flashinfer.py);
#   3. as the image's non-root user (uid 10001) with FLASHINFER_DISABLE_JIT=1 (so any kernel not
#      shipped prebuilt is an error, not a silent compile): a short offline benchmark, a served
#      chat request through the five-service stack, and a short serving benchmark.
# Results (JSON lines and logs) go to OUTDIR.
set -uo pipefail
out=${1:?usage: gpu_image_check.sh OUTDIR}
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
step() { printf '\n== %s (%s)\n' "$*" "$(date +%T)"; }

step "install FlashInfer, the services' dependencies and the six packages (no network)"
# As the image's pip does, into the interpreter's own site-packages; wheels come from .whl/.
python3 -m pip install -q --no-index --no-deps --no-compile .whl/flashinfer_python-*.whl \
  .whl/apache_tvm_ffi-*.whl || exit 1
python3 -m pip install -q --no-index --find-links .whl/py fastapi uvicorn jinja2 prometheus-client \
  grpcio-health-checking grpcio-reflection httpx httptools einops tabulate || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation libs/minisgl_core \
  services/tokenizer services/scheduler services/worker services/gateway apps/minisgl || exit 1
python3 -m pip freeze > "$out/image-freeze.txt" 2>/dev/null

step "installed packages vs deploy/docker/constraints-cuda.txt"
python3 - "$here/deploy/docker/constraints-cuda.txt" <<'EOF' | tee "$out/pins.txt"
import importlib.metadata as md, re, sys
bad = 0
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, want = re.split(r"==", line, maxsplit=1)
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    ok = have is not None and (have == want or have.split("+")[0] == want.split("+")[0])
    bad += not ok
    print(f"{'ok ' if ok else 'BAD'} {name}: pinned {want}, host {have}")
print(f"pins: {bad} mismatched")
EOF

step "prebuild FlashInfer kernels (the image's build step; nvcc, no GPU needed)"
FLASHINFER_WORKSPACE_BASE=/tmp/fi-build python3 deploy/docker/prebuild_flashinfer.py \
  --head-dims 64,128 --kv-dtypes auto --fa3 2>&1 | tail -5 | tee "$out/prebuild.txt"

step "as uid 10001, FLASHINFER_DISABLE_JIT=1"
id minisgl >/dev/null 2>&1 || useradd --uid 10001 --create-home minisgl
chmod -R a+rX "$here"
as_user() {
  setpriv --reuid=10001 --regid=10001 --clear-groups env HOME=/home/minisgl \
    FLASHINFER_DISABLE_JIT=1 FLASHINFER_WORKSPACE_BASE=/home/minisgl \
    TRITON_CACHE_DIR=/home/minisgl/.triton "$@"
}
as_user python3 -c 'import os, torch, flashinfer; print("uid", os.getuid(), torch.__version__,
  torch.version.cuda, flashinfer.__version__, torch.cuda.get_device_name())' | tee "$out/who.txt"

# The offline benchmark and the stack need a tokenizer beside config.json (bench.common.model_dir).
python3 -m bench.common.model_dir models/configs/Qwen3-0.6B /tmp/q06 >/dev/null && chmod -R a+rX /tmp/q06
gpu_free() {  # a stopped stack's worker drains last and holds GPU memory until it exits
  for _ in $(seq 120); do
    [ "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)" -lt 2048 ] && return
    sleep 1
  done
}
# The image's user cannot write root's OUTDIR: results go through a folder of its own.
res=/home/minisgl/results; mkdir -p "$res"; chown 10001:10001 "$res"

step "offline benchmark, Qwen3-0.6B dummy weights, flashinfer attention, 64 sequences"
as_user python3 -m bench.offline --model /tmp/q06 --attention-backend flashinfer \
  --num-seqs 64 --json "$res/offline.jsonl" > "$out/offline.log" 2>&1
echo "rc=$?"; tail -3 "$out/offline.log"

step "served chat request: minisgl serve (tiny model, cuda, flashinfer) + curl"
as_user python3 -m minisgl.cli serve --model models/tiny --worker-args "--attention-backend flashinfer" \
  > "$out/serve.log" 2>&1 &
for _ in $(seq 180); do
  curl -sf http://127.0.0.1:8000/ready >/dev/null && break; sleep 1
done
curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"model": "tiny", "max_tokens": 24, "temperature": 0,
       "messages": [{"role": "user", "content": "Who made the heaven?"}]}' | tee "$out/chat.json"
echo
curl -s http://127.0.0.1:8000/metrics | grep -E '^minisgl_.*(requests_total|generation_tokens_total)' | head -5
# $! is the subshell around as_user, not the launcher: signal the launcher by its command line.
for p in /proc/[0-9]*; do  # (no procps on the GPU image)
  tr '\0' ' ' < "$p/cmdline" 2>/dev/null | grep -q "^python3 -m minisgl.cli serve" && kill -TERM "${p#/proc/}"
done
wait; gpu_free

step "serving benchmark: the five-service stack, Qwen3-0.6B dummy, 128 requests at 64 streams"
as_user python3 -m bench.serving --launch --model /tmp/q06 --load-format dummy \
  --worker-args "--attention-backend flashinfer" --num-requests 128 --concurrency 64 \
  --json "$res/serving.jsonl" > "$out/serving.log" 2>&1
echo "rc=$?"; tail -3 "$out/serving.log"
cp "$res"/*.jsonl "$out"/ 2>/dev/null; cat "$out"/*.jsonl 2>/dev/null
