#!/usr/bin/env bash
# Build the Dockerfile's base image locally, for machines that cannot pull from a registry.
#
# The Dockerfile says `FROM python:3.11-slim-bookworm` (the official image users pull).
# Here no registry is reachable, so this script makes an equivalent: a minimal Debian
# bookworm (debootstrap) with python3, venv and pip, plus this machine's CA bundle so
# that pip can reach PyPI through a TLS-intercepting proxy, and imports it under that tag.
#
# Usage: scripts/build_base_image.sh [TAG]      (needs root, debootstrap and docker)
set -euo pipefail

TAG="${1:-python:3.11-slim-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG already present"
  exit 0
fi

ROOTFS="$(mktemp -d /tmp/kvcoord-rootfs.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT

echo "debootstrap bookworm into $ROOTFS (a few minutes)..."
debootstrap --variant=minbase \
  --include=python3,python3-venv,python3-pip,ca-certificates \
  bookworm "$ROOTFS" "$MIRROR" >/tmp/kvcoord-debootstrap.log 2>&1 || {
    tail -n 40 /tmp/kvcoord-debootstrap.log >&2
    exit 1
  }

# The host's bundle includes the proxy's CA; pip inside `docker build` needs it.
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
fi
# Keep the image small: no package lists, docs or caches.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/* "$ROOTFS"/usr/share/doc/* \
       "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/*

tar -C "$ROOTFS" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["python3"]' \
  - "$TAG" >/dev/null
echo "imported base image $TAG"
