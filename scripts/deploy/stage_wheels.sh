#!/usr/bin/env bash
# Copies the CPU torch wheel the Dockerfile pins (constraints-cpu.txt) for the base image's Python
# from pip's find-links directories (PIP_FIND_LINKS, pip's config) into deploy/docker/wheels/,
# where the worker-cpu build picks it up (TORCH_SOURCE=auto/local) instead of the PyTorch CPU
# index. Finding none is fine: the build then uses the index.
source "$(dirname "$0")/common.sh"
DEST="$ROOT/deploy/docker/wheels"
version="$(sed -n 's/^torch==//p' "$ROOT/deploy/docker/constraints-cpu.txt")"
pytag="${MINISGL_IMAGE_PYTAG:-cp311}"  # the Python of the CPU images' base (Debian bookworm: 3.11)
dirs="${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true)"
for dir in $dirs; do
  dir="${dir#file://}"
  for wheel in "$dir"/torch-"$version"+cpu-"$pytag"-"$pytag"-*linux*_x86_64.whl; do
    [ -f "$wheel" ] || continue
    if ! cmp -s "$wheel" "$DEST/$(basename "$wheel")"; then
      log "staging $(basename "$wheel") for the worker-cpu image"
      cp "$wheel" "$DEST/"
    fi
    exit 0
  done
done
log "no torch $version CPU wheel for $pytag in pip's find-links; worker-cpu installs torch from the index"
