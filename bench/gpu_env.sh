#!/usr/bin/env bash
# Source this on the GPU machine (no network) before a benchmark:  source bench/gpu_env.sh
# Wheels travel in .whl/ (see docs/benchmarks.md): FlashInfer 0.6.4 + apache-tvm-ffi go into a
# private folder; the pure-Python service deps are installed only where the image lacks them.
# .whl/py is filled here with: pip download --only-binary=:all: --python-version 3.12
#   --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
#   --platform manylinux2014_x86_64 --platform any -d .whl/py "fastapi<0.116" uvicorn jinja2
#   prometheus-client grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 einops tabulate
#   httpx httptools pytest pytest-timeout   (then delete the grpcio and protobuf wheels: the
#   image has its own; pytest runs tests/gpu: make test-gpu PY=python3)
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -d "$here/.whl" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$here"/.whl/flashinfer_python-*.whl "$here"/.whl/apache_tvm_ffi-*.whl \
    >/dev/null 2>&1 || echo "gpu_env: FlashInfer wheels did not install"
  # pip dates the files it installs now, later than the objects of the carried JIT cache
  # (.device/fi-cache.tgz, below) built from the same sources: ninja then rebuilt the FA3
  # prefill module in every fresh call (~85 s, the other TP rank waiting on its lock). Dated
  # back, the installed sources are older than those objects and the cached builds load as is.
  find /tmp/site -exec touch -h -d @946684800 {} + 2>/dev/null || true
  if [ -d "$here/.whl/py" ]; then
    python3 -m pip install -q --no-index --find-links "$here/.whl/py" fastapi uvicorn jinja2 \
      prometheus-client grpcio-health-checking grpcio-reflection einops tabulate httpx \
      >/tmp/gpu_env_pip.log 2>&1 || { echo "gpu_env: service wheels did not install:"; tail -3 /tmp/gpu_env_pip.log; }
    # Optional: tracing (bench/serving.py --otel) and progress bars; without them the services
    # run untraced and without bars. Fill .whl/py with: pip download ... -d .whl/py
    #   opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc tqdm  (pure Python)
    python3 -m pip install -q --no-index --find-links "$here/.whl/py" opentelemetry-sdk \
      opentelemetry-exporter-otlp-proto-grpc tqdm >/dev/null 2>&1 || true
    # Optional: structured outputs (llguidance, one abi3 wheel: pip download --no-deps
    #   --only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64 llguidance==1.9.1)
    python3 -m pip install -q --no-index --find-links "$here/.whl/py" llguidance >/dev/null 2>&1 || true
    # Optional: uvicorn uses httptools when present (the gateway declares it), h11 otherwise.
    python3 -m pip install -q --no-index --find-links "$here/.whl/py" httptools >/dev/null 2>&1 || true
    # For tests/gpu (make test-gpu PY=python3), where the image lacks pytest.
    python3 -m pip install -q --no-index --find-links "$here/.whl/py" pytest pytest-timeout >/dev/null 2>&1 || true
  fi
fi
export PYTHONPATH="/tmp/site:$here/libs/minisgl_core:$here/apps/minisgl:$here/services/gateway:$here/services/tokenizer:$here/services/scheduler:$here/services/worker${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-cache}
# A JIT cache carried from an earlier run (.device/fi-cache.tgz) saves minutes of compiling.
if [ -f "$here/.device/fi-cache.tgz" ] && [ ! -d /tmp/fi-cache ]; then
  tar xzf "$here/.device/fi-cache.tgz" -C /tmp
fi
