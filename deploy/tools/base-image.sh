#!/usr/bin/env bash
# Makes a Debian base image with Python 3 and its venv module, without any registry:
# debootstrap into a folder, then `docker import`. The deployment tests build
# deploy/Dockerfile on it (BASE=TAG), since no image registry can be assumed.
#
#     deploy/tools/base-image.sh [TAG]        (default hora-test-base:bookworm)
#
# Does nothing when TAG exists. Environment: HORA_DEBIAN_SUITE (bookworm),
# HORA_DEBIAN_MIRROR (http://deb.debian.org/debian). Needs root and debootstrap.
set -euo pipefail
TAG=${1:-hora-test-base:bookworm}
SUITE=${HORA_DEBIAN_SUITE:-bookworm}
MIRROR=${HORA_DEBIAN_MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base-image: $TAG exists"; exit 0
fi
root=$(mktemp -d /var/tmp/hora-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
started=$(date +%s)
if ! timeout 900 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
     "$SUITE" "$root" "$MIRROR" > "$root.log" 2>&1; then
  tail -n 30 "$root.log" >&2; rm -f "$root.log"
  echo "base-image: debootstrap $SUITE from $MIRROR failed (log above)" >&2; exit 1
fi
rm -f "$root.log"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import \
  -c 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  -c 'CMD ["python3"]' -m "debootstrap --variant=minbase $SUITE + python3, python3-venv" \
  - "$TAG" >/dev/null
echo "base-image: $TAG made in $(( $(date +%s) - started )) s"
