#!/usr/bin/env bash
# Source this on the GPU machine (no network) before a benchmark:  source bench/gpu_env.sh
# Wheels travel in .whl/ (see docs/benchmarks.md): FlashInfer 0.6.4 + apache-tvm-ffi go into a
# private folder; the pure-Python service deps are installed only where the image lacks them.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -d "$here/.whl" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$here"/.whl/flashinfer_python-*.whl "$here"/.whl/apache_tvm_ffi-*.whl \
    >/dev/null 2>&1 || echo "gpu_env: FlashInfer wheels did not install"
  if [ -d "$here/.whl/py" ]; then
    python3 -m pip install -q --no-index --find-links "$here/.whl/py" fastapi uvicorn jinja2 \
      prometheus-client grpcio-health-checking grpcio-reflection einops tabulate httpx \
      >/tmp/gpu_env_pip.log 2>&1 || { echo "gpu_env: service wheels did not install:"; tail -3 /tmp/gpu_env_pip.log; }
  fi
fi
export PYTHONPATH="/tmp/site:$here/libs/minisgl_core:$here/libs/minisgl:$here/services/gateway:$here/services/tokenizer:$here/services/scheduler:$here/services/worker${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-cache}
# A JIT cache carried from an earlier run (.device/fi-cache.tgz) saves minutes of compiling.
if [ -f "$here/.device/fi-cache.tgz" ] && [ ! -d /tmp/fi-cache ]; then
  tar xzf "$here/.device/fi-cache.tgz" -C /tmp
fi
