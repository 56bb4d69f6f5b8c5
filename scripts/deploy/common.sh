# Shared settings of the deploy scripts (sourced, not run).
# Everything they make lives under .cache/deploy (git-ignored) or in the Docker engine itself.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEPLOY_CACHE="${MINISGL_DEPLOY_CACHE:-$ROOT/.cache/deploy}"
TOOLS_VENV="$DEPLOY_CACHE/tools"
export DOCKER_CONFIG="${DOCKER_CONFIG:-$HOME/.docker}"
# Versions of the tools and of the third-party images: compose.yml pins the same image tags.
COMPOSE_VERSION="2.40.3"
ENVOY_VERSION="1.40.0"
ENVOY_IMAGE="envoyproxy/envoy:v$ENVOY_VERSION"
PROMETHEUS_IMAGE="prom/prometheus:v2.42.0"  # Debian bookworm's prometheus is 2.42
# The Dockerfile's default base; on a machine without a registry it is made here from Debian.
BASE_IMAGE="python:3.11-slim-bookworm"
# A label on what these scripts build, so a real image of the same name is never replaced.
LOCAL_LABEL="org.minisgl.local-stand-in"

log() { echo "[deploy] $*" >&2; }
mkdir -p "$DEPLOY_CACHE"

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }

# tool_file MODULE RELPATH: a file shipped inside a package of the tools venv.
tool_file() {
  "$TOOLS_VENV/bin/python" -c 'import importlib, pathlib, sys
mod = importlib.import_module(sys.argv[1])
print(pathlib.Path(mod.__file__).parent / sys.argv[2])' "$1" "$2"
}
