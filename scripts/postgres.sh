#!/usr/bin/env bash
# Make PostgreSQL's server binaries available for the service's PostgreSQL tests (idempotent) and
# print their directory. Missing: install Debian's `postgresql` package with apt-get (as root, or with
# sudo). The tests start their own throwaway server from these binaries (initdb into a temp dir, run
# as the non-root `postgres` user); nothing is started here and no system cluster is used.
#   bindir=$(bash scripts/postgres.sh)
set -euo pipefail

find_bin() {
  local d
  for d in "${PF_TRL_POSTGRES_BIN:-}" $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r) \
           "$(dirname "$(command -v pg_ctl 2>/dev/null || echo /nonexistent/x)")"; do
    if [[ -n "$d" && -x "$d/initdb" && -x "$d/pg_ctl" && -x "$d/postgres" ]]; then
      echo "$d"
      return 0
    fi
  done
  return 1
}

if find_bin; then
  exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "postgres.sh: PostgreSQL is not installed and this user cannot install it (not root, no sudo);" \
         "install Debian's postgresql package, or set PF_TRL_SKIP_POSTGRES=1 to skip its tests" >&2
    exit 1
  fi
fi
if ! command -v apt-get >/dev/null; then
  echo "postgres.sh: PostgreSQL is not installed and there is no apt-get; install PostgreSQL >= 13 and set" \
       "PF_TRL_POSTGRES_BIN to its bin directory" >&2
  exit 1
fi
echo "postgres.sh: installing postgresql (apt-get)" >&2
$SUDO apt-get update -qq >&2
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >&2
# Debian's package starts a system cluster; the tests do not use it.
find_bin
