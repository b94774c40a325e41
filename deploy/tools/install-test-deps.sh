#!/usr/bin/env bash
# Installs what the deployment tests (tests/deploy) need, each only when missing:
#   - Debian packages docker.io (the engine) and debootstrap (the tests' base image),
#   - the Docker Compose v2 CLI plugin, taken from the next Debian release's
#     docker-compose package (bookworm's own docker-compose is v1) with a private apt
#     state, so this machine's apt sources stay as they are,
#   - kubernetes-validate in the given Python (the "deploy" extra of pyproject.toml).
# Usage: install-test-deps.sh PYTHON      (the virtualenv's python that runs the tests)
# Debian or Ubuntu, as root; kubectl is not installed here (the k8s tests skip without it).
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

if ! docker compose version >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ]; then
    say "needs root to install the Compose v2 plugin into $PLUGIN_DIR"; exit 1
  fi
  say "installing the Compose v2 plugin from Debian $COMPOSE_SUITE's docker-compose"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
  echo "deb $DEBIAN_MIRROR $COMPOSE_SUITE main" > "$work/sources.list"
  apt_private=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=-"
               -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
               -o "APT::Get::List-Cleanup=0" -o "APT::Sandbox::User=root")
  timeout 600 apt-get "${apt_private[@]}" update -qq
  (cd "$work" && timeout 600 apt-get "${apt_private[@]}" download docker-compose >/dev/null)
  dpkg-deb -x "$work"/docker-compose_*.deb "$work/root"
  plugin=$(find "$work/root" -type f -path '*cli-plugins/docker-compose' | head -n1)
  if [ -z "$plugin" ]; then
    plugin=$(find "$work/root" -type f -name docker-compose -perm -u+x | head -n1)
  fi
  [ -n "$plugin" ] || { say "no docker-compose binary in $(ls "$work"/docker-compose_*.deb)"; exit 1; }
  install -D -m 0755 "$plugin" "$PLUGIN_DIR/docker-compose"
  docker compose version
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
say "$(docker --version), $(docker compose version --short 2>/dev/null | sed 's/^/compose /'), debootstrap $(dpkg-query -W -f='${Version}' debootstrap 2>/dev/null || echo '?')"
