#!/usr/bin/env bash
# Optional system tools the tests use when they can be had: Debian's prometheus (a real scrape test).
# Never fails: a test whose tool is missing skips with a message saying so.
set -u
if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's prometheus for the scrape test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus) \
      >/dev/null 2>&1 || echo "prometheus could not be installed; its test will skip"
  fi
fi
# Debian starts the packaged service; the tests run their own instance.
if command -v systemctl >/dev/null 2>&1; then systemctl stop prometheus >/dev/null 2>&1; fi
exit 0
