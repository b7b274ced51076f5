#!/usr/bin/env bash
# Build a Debian bookworm base image with debootstrap, for machines that reach Debian's package mirror but
# no image registry. Usage: deploy/docker/build-base-image.sh [TAG] [MIRROR]   (root; needs debootstrap).
# The image has python3 (3.11) and python3-venv; the nitsum Dockerfile builds on it with BASE_IMAGE=TAG.
set -euo pipefail
TAG="${1:-nitsum-base:bookworm}"
MIRROR="${2:-${DEBIAN_MIRROR:-http://deb.debian.org/debian}}"
if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG exists"; exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap not found: apt-get install -y debootstrap" >&2; exit 1; }
ROOT="$(mktemp -d "${TMPDIR:-/var/tmp}/nitsum-rootfs.XXXXXX")"
trap 'rm -rf "$ROOT"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$ROOT" "$MIRROR"
chroot "$ROOT" apt-get clean
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin
tar -C "$ROOT" -c . | docker import -c 'ENV LANG=C.UTF-8' - "$TAG"
echo "built base image $TAG"
