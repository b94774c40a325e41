#!/usr/bin/env bash
# Fills deploy/wheels/ with the wheels deploy/Dockerfile installs (torch and the rest), for
# an image whose Python is PYVER, so that the build needs no index (PIP_OFFLINE=1).
#
#     deploy/tools/wheelhouse.sh PYTHON PYVER [EXTRAS]
#
# PYTHON runs pip (its index configuration is used, e.g. /etc/pip.conf); PYVER is the
# image's Python (3.11 for Debian bookworm); EXTRAS as HORA_EXTRAS (default: examples).
# Environment: TORCH_VERSION (2.13.0), HORA_TORCH_INDEX_URL: an extra index that has
# torch's CPU wheel (e.g. https://download.pytorch.org/whl/cpu) where pip's own
# configuration has none. Only torch's CPU wheel is taken: a CUDA one is an error.
# Does nothing when the wheelhouse was made for the same requirements (deploy/wheels/.stamp).
set -euo pipefail
PYTHON=${1:?usage: wheelhouse.sh PYTHON PYVER [EXTRAS]}
PYVER=${2:?usage: wheelhouse.sh PYTHON PYVER [EXTRAS]}
EXTRAS=${3:-examples}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$ROOT/deploy/wheels

reqs=$("$PYTHON" "$ROOT/deploy/tools/requirements.py" "$ROOT/pyproject.toml" "$EXTRAS")
build_reqs=$("$PYTHON" -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))' "$ROOT/pyproject.toml")
stamp=$(printf '%s\n' "$PYVER" "torch==$TORCH_VERSION+cpu" "$reqs" "$build_reqs" | sha256sum | cut -c1-16)
if [ -f "$OUT/.stamp" ] && [ "$(cat "$OUT/.stamp")" = "$stamp" ] \
   && compgen -G "$OUT/torch-*.whl" >/dev/null; then
  echo "wheelhouse: up to date ($OUT)"; exit 0
fi

extra_index=()
if [ -n "${HORA_TORCH_INDEX_URL:-}" ]; then extra_index=(--extra-index-url "$HORA_TORCH_INDEX_URL"); fi
work=$(mktemp -d "$OUT/.partial.XXXXXX")
trap 'rm -rf "$work"' EXIT
printf '%s\n' "$reqs" "$build_reqs" > "$work/requirements.txt"
# One resolution for everything, torch's CPU build included, for the image's Python.
timeout 900 "$PYTHON" -m pip download -q --dest "$work/all" --only-binary=:all: \
  --python-version "$PYVER" "${extra_index[@]}" \
  -r "$work/requirements.txt" "torch==$TORCH_VERSION+cpu"
if compgen -G "$work/all/nvidia_*.whl" >/dev/null; then
  echo "wheelhouse: CUDA wheels were pulled in ($(cd "$work/all" && ls nvidia_* | head -3)...)" >&2
  exit 1
fi
rm -f "$OUT"/*.whl "$OUT/.stamp"
mv "$work"/all/*.whl "$OUT/"
echo "$stamp" > "$OUT/.stamp"
echo "wheelhouse: $(cd "$OUT" && ls torch-*.whl) and $(ls "$OUT" | grep -c -v -e '^torch-' -e README) other wheels in $OUT"
