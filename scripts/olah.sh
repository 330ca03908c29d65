#!/usr/bin/env bash
# Make olah (a self-hosted Hugging Face Hub mirror, https://github.com/vtuber-plan/olah) available for the Hub
# tests (idempotent) and print the python of its venv. olah pins its own FastAPI stack, so it lives in its own venv
# (.venv-olah, or $PF_TRL_OLAH_VENV), installed from PyPI when missing. The tests start their own server from it
# (tests/hub_server.py: olah plus two small shims for its offline answers); nothing is started here.
#   python=$(bash scripts/olah.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
OLAH_VERSION=0.5.4
venv=${PF_TRL_OLAH_VENV:-$PWD/.venv-olah}
py="$venv/bin/python"

installed() {
  [[ -x "$py" ]] && "$py" -c "import importlib.metadata as m, sys; sys.exit(m.version('olah') != '$OLAH_VERSION')" \
    2>/dev/null
}

if ! installed; then
  echo "olah.sh: installing olah $OLAH_VERSION into $venv" >&2
  base=${PYTHON:-python3}
  [[ -x "$py" ]] || "$base" -m venv "$venv" >&2
  "$py" -m pip install -q --disable-pip-version-check "olah==$OLAH_VERSION" >&2
  installed || { echo "olah.sh: olah $OLAH_VERSION did not install into $venv" >&2; exit 1; }
fi
echo "$py"
