#!/usr/bin/env bash
# Stand-ins for the Docker Hub images the compose file and the Dockerfiles start FROM, for an engine
# that cannot reach Docker Hub (the test's fallback, never the product's): one Debian bookworm rootfs
# (debootstrap) with Debian's Python, redis and nginx, imported once and tagged under each FROM name,
# and for the worker's PyTorch base the Python stand-in plus torch from the package index. An image
# that is present already (pulled or built before) is kept.
#
#   tests/deploy/standins.sh IMAGE...    e.g. python:3.11-slim redis:7-alpine nginx:1.27-alpine
set -euo pipefail

BASE=slotq-standin/debian:bookworm
MIRROR=${SLOTQ_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# Debian 12's Python is 3.11, the floor of the project and of the images it stands in for.
PACKAGES=python3,python3-pip,python-is-python3,ca-certificates,redis-server,redis-tools,nginx-light,wget,gcc,libc6-dev
TORCH=${SLOTQ_STANDIN_TORCH:-torch==2.13.0}

present() { docker image inspect "$1" >/dev/null 2>&1; }

# From the Dockerfile on standard input, written into the context $2 first (the client reads its
# context before its standard input), with the classic builder: no BuildKit front end to fetch.
build() {
  cat >"$2/Dockerfile"
  DOCKER_BUILDKIT=0 docker build --quiet -t "$1" "$2" >/dev/null
}

base() {
  present "$BASE" && return
  local root
  root=$(mktemp -d)
  debootstrap --variant=minbase --include="$PACKAGES" bookworm "$root" "$MIRROR" >/dev/null
  # pip inside builds reaches the registries through this machine's TLS proxy, if it has one.
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$root/etc/pip.conf"
  # The official python images install packages system-wide with pip; so must their stand-in.
  rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
  tar -C "$root" -c . | docker import - "$BASE" >/dev/null
  rm -rf "$root"
}

standin() {
  local image=$1 context
  present "$image" && return
  [[ $image == pytorch/pytorch:* ]] && standin python:3.11-slim
  context=$(mktemp -d)
  case "$image" in
    python:*)
      printf 'FROM %s\nCMD ["python3"]\n' "$BASE" ;;
    redis:*)
      # As the official image's entrypoint does: no protected mode, so other containers may connect.
      printf '#!/bin/sh\n[ "$1" = redis-server ] && set -- "$@" --protected-mode no\nexec "$@"\n' \
        >"$context/entrypoint.sh"
      chmod 755 "$context/entrypoint.sh"
      printf 'FROM %s\nCOPY entrypoint.sh /usr/local/bin/\nWORKDIR /data\n' "$BASE"
      printf 'ENTRYPOINT ["entrypoint.sh"]\nCMD ["redis-server"]\n' ;;
    nginx:*)
      printf 'FROM %s\nCMD ["nginx", "-g", "daemon off;"]\n' "$BASE" ;;
    pytorch/pytorch:*)
      # torch's wheels from this machine's index (its own settings: a CPU build where it has one).
      python3 -m pip download --quiet --only-binary :all: --dest "$context" "$TORCH"
      printf 'FROM python:3.11-slim\nCOPY *.whl /tmp/wheels/\n'
      printf 'RUN pip install --no-cache-dir --no-index --find-links /tmp/wheels /tmp/wheels/torch-*.whl'
      printf ' && rm -rf /tmp/wheels\n' ;;
    *)
      echo "no stand-in for $image" >&2
      return 1 ;;
  esac >"$context.dockerfile"
  build "$image" "$context" <"$context.dockerfile"
  rm -rf "$context" "$context.dockerfile"
}

base
for image in "$@"; do
  standin "$image"
done
