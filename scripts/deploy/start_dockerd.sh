#!/usr/bin/env bash
# Starts the Docker daemon in the background unless one already answers, and waits for it.
# The daemon is left running (later runs reuse it and its layer cache); stop it by the pid in
# .cache/deploy/dockerd.pid. Its log is .cache/deploy/dockerd.log.
source "$(dirname "$0")/common.sh"

if docker info >/dev/null 2>&1; then
  exit 0
fi
command -v dockerd >/dev/null 2>&1 || { log "no dockerd: run scripts/deploy/install_docker.sh"; exit 1; }
log "starting dockerd (log: $DEPLOY_CACHE/dockerd.log)"
# setsid: the daemon outlives the shell and the make/CI job that started it.
setsid dockerd >"$DEPLOY_CACHE/dockerd.log" 2>&1 < /dev/null &
echo $! >"$DEPLOY_CACHE/dockerd.pid"
for _ in $(seq 1 120); do
  if docker info >/dev/null 2>&1; then
    log "dockerd is up (pid $(cat "$DEPLOY_CACHE/dockerd.pid"))"
    exit 0
  fi
  if ! kill -0 "$(cat "$DEPLOY_CACHE/dockerd.pid")" 2>/dev/null; then
    log "dockerd exited; its log:"; tail -20 "$DEPLOY_CACHE/dockerd.log" >&2; exit 1
  fi
  sleep 0.5
done
log "dockerd did not answer within 60 s; its log:"; tail -20 "$DEPLOY_CACHE/dockerd.log" >&2
exit 1
