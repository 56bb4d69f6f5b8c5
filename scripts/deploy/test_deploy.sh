#!/usr/bin/env bash
# `make test-deploy`: set up Docker, build the images, start the CPU stack under its own project
# name and free host ports, run tests/deploy_e2e against it (through Envoy), and tear it down.
# Prints the time of each phase.
source "$(dirname "$0")/common.sh"
PY="${PY:-$ROOT/.venv/bin/python}"
cd "$ROOT"
t0=$SECONDS
phase() { log "$1 done in $((SECONDS - t_phase)) s"; t_phase=$SECONDS; }
t_phase=$SECONDS

bash scripts/deploy/setup.sh
phase setup

export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-minisgl-e2e}"
export COMPOSE_BAKE=false  # no buildx here: the engine's builder, without a warning
read -r MINISGL_HTTP_PORT MINISGL_PROMETHEUS_PORT MINISGL_ENVOY_ADMIN_PORT < <("$PY" -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
export MINISGL_HTTP_PORT MINISGL_PROMETHEUS_PORT MINISGL_ENVOY_ADMIN_PORT MINISGL_PUBLISH_ADDR=127.0.0.1
compose=(docker compose --profile cpu)
# A stack left over from an interrupted run would hold the project's names.
"${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
trap '"${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true' EXIT

"${compose[@]}" build --quiet
phase "docker compose build"
if ! "${compose[@]}" up --detach --wait --wait-timeout 300 --quiet-pull; then
  "${compose[@]}" ps -a
  "${compose[@]}" logs --tail 40
  exit 1
fi
phase "docker compose up --wait"

"$PY" -m pytest tests/deploy_e2e -v -p no:cacheprovider
phase "tests/deploy_e2e"
log "make test-deploy took $((SECONDS - t0)) s"
