#!/usr/bin/env bash
# Installs what the deployment tests (tests/deploy) need, each only when missing:
#   - Debian packages docker.io (the engine) and debootstrap (the tests' base image),
#   - the Docker Compose v2 CLI plugin, taken from the next Debian release's
#     docker-compose package (bookworm's own docker-compose is v1) with a private apt
#     state, so this machine's apt sources stay as they are,
#   - kustomize, from the next Debian release too, where kubectl (which has it) is missing,
#   - kubernetes-validate in the given Python (the "deploy" extra of pyproject.toml).
# Usage: install-test-deps.sh PYTHON      (the virtualenv's python that runs the tests)
# Debian or Ubuntu, as root.
set -euo pipefail
PYTHON=${1:?usage: install-test-deps.sh PYTHON}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
COMPOSE_SUITE=${HORA_COMPOSE_SUITE:-trixie}
DEBIAN_MIRROR=${HORA_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins

say() { echo "deploy-deps: $*"; }

missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if ((${#missing[@]})); then
  if [ "$(id -u)" != 0 ]; then
    say "needs root to install ${missing[*]} (apt-get)"; exit 1
  fi
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  timeout 600 apt-get update -qq
  timeout 900 apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The next Debian release's packages, fetched with a private apt state (this machine's
# apt sources stay as they are) and unpacked, not installed: their Go binaries stand alone.
work=""
next_debian() {  # next_debian PACKAGE BINARY-NAME DEST: unpacks BINARY-NAME to DEST
  if [ "$(id -u)" != 0 ]; then
    say "needs root to install $2 (from Debian $COMPOSE_SUITE's $1) into $3"; exit 1
  fi
  if [ -z "$work" ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
    echo "deb $DEBIAN_MIRROR $COMPOSE_SUITE main" > "$work/sources.list"
    apt_private=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=-"
                 -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
                 -o "APT::Get::List-Cleanup=0" -o "APT::Sandbox::User=root")
    timeout 600 apt-get "${apt_private[@]}" update -qq
  fi
  say "installing $2 from Debian $COMPOSE_SUITE's $1"
  (cd "$work" && timeout 600 apt-get "${apt_private[@]}" download "$1" >/dev/null)
  rm -rf "$work/root"
  dpkg-deb -x "$work"/"$1"_*.deb "$work/root"
  local binary
  binary=$(find "$work/root" -type f -name "$2" -perm -u+x | head -n1)
  [ -n "$binary" ] || { say "no $2 binary in $(ls "$work"/"$1"_*.deb)"; exit 1; }
  install -D -m 0755 "$binary" "$3"
}

if ! docker compose version >/dev/null 2>&1; then
  next_debian docker-compose docker-compose "$PLUGIN_DIR/docker-compose"
  docker compose version
fi

# The Kubernetes tests build the manifests with `kubectl kustomize`, or `kustomize build`
# where there is no kubectl (Debian bookworm's kubectl is too old for components).
if ! kubectl kustomize --help >/dev/null 2>&1 && ! command -v kustomize >/dev/null 2>&1; then
  next_debian kustomize kustomize /usr/local/bin/kustomize
  kustomize version
fi

if ! "$PYTHON" -c "import kubernetes_validate" >/dev/null 2>&1; then
  say "installing kubernetes-validate into $PYTHON's environment"
  deps=$("$PYTHON" - "$ROOT/pyproject.toml" <<'PY'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
try:
    import tomllib
    print(" ".join(tomllib.loads(text)["project"]["optional-dependencies"]["deploy"]))
except ImportError:  # Python 3.10: the one line of the extra
    print(" ".join(re.findall(r'"([^"]+)"', re.search(r"^deploy = \[(.*)\]$", text, re.M)[1])))
PY
)
  # shellcheck disable=SC2086
  timeout 600 "$PYTHON" -m pip install -q $deps
fi
say "$(docker --version), $(docker compose version --short 2>/dev/null | sed 's/^/compose /'), $(if kubectl kustomize --help >/dev/null 2>&1; then echo "kubectl kustomize"; else echo "kustomize $(kustomize version 2>/dev/null)"; fi), debootstrap $(dpkg-query -W -f='${Version}' debootstrap 2>/dev/null || echo '?')"
