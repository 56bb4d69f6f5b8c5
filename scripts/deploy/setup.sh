#!/usr/bin/env bash
# Everything `docker compose build/up` needs on a fresh Debian machine without a registry, each step
# idempotent: Docker Engine + Compose v2, a running daemon, the base and stand-in images, and the
# local CPU torch wheel staged for the worker image.
source "$(dirname "$0")/common.sh"
bash "$ROOT/scripts/deploy/install_docker.sh"
bash "$ROOT/scripts/deploy/start_dockerd.sh"
bash "$ROOT/scripts/deploy/build_local_images.sh"
bash "$ROOT/scripts/deploy/stage_wheels.sh"
