#!/usr/bin/env bash
# The coverage sweep on the newest transformers release as well as the pinned one: support.json must hold a fresh
# sweep of both (python -m pf_trl_dev.coverage --write, run once with each).
#
# .venv-newest is a thin layer over .venv: its own transformers (and what that release needs beyond .venv), with
# .venv's site-packages (torch, trl, datasets, pf-trl editable...) added after its own. Created in ~20 s from the
# local wheel cache; nothing else is installed twice. Then the sweep's tests run in it (about a minute on 2 cores).
#   PF_NEWEST_VENV   venv path (default .venv-newest)
#   Extra arguments go to pytest; `--prepare` alone only creates the venv.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${PF_NEWEST_VENV:-.venv-newest}"
BASE=.venv
# The newest release in the package registry and the packages it needs that .venv does not have; bump together
# with support.json (run the sweep with --write in this venv).
PINS=("transformers==5.25.0" "kernels==0.19.1" "tomlkit==0.15.3")

venv_ok() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "${PINS[0]#transformers==}" <<'PYEOF' 2>/dev/null
import sys, transformers, torch, pf_trl
assert transformers.__version__ == sys.argv[1], transformers.__version__
assert torch.version.cuda is None, "CUDA torch"
PYEOF
}

if ! venv_ok; then
  [ -x "$BASE/bin/python" ] || { echo "[test_newest] $BASE is missing: run scripts/setup.sh first" >&2; exit 1; }
  start=$(date +%s)
  echo "[test_newest] creating $VENV (${PINS[*]} over $BASE)"
  rm -rf "$VENV"
  PY=$("$BASE/bin/python" -c "import sys, os; print(os.path.join(sys.base_prefix, 'bin', 'python3'))")
  "$PY" -m venv "$VENV"
  site_new=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  site_base=$("$BASE/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # addsitedir, not a plain path: .venv's own .pth files (the editable pf-trl) are processed too
  echo "import site; site.addsitedir('$(cd "$site_base" && pwd)')" > "$site_new/zz_pf_trl_base.pth"
  # --no-compile: pip would byte-compile all of transformers (~9 CPU-s); the suite's one process compiles only the
  # modules it imports (~3-5 CPU-s more at its start), so the layer is ready sooner and costs less in all
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile "${PINS[@]}"
  # only what the pins need (the layer's own pip/setuptools shadow .venv's: not our concern)
  missing=$("$VENV/bin/python" -m pip check 2>/dev/null | grep -E "^(transformers|kernels|tomlkit) " || true)
  if [[ -n "$missing" ]]; then
    echo "$missing" >&2
    echo "[test_newest] $VENV misses a dependency of ${PINS[0]}: add it to PINS" >&2
    exit 1
  fi
  venv_ok || { echo "[test_newest] $VENV is broken after install" >&2; exit 1; }
  echo "[test_newest] venv ready in $(( $(date +%s) - start )) s"
fi
[[ "${1:-}" == --prepare ]] && exit 0

"$VENV/bin/python" -c "import transformers; print(f'[test_newest] transformers {transformers.__version__}')"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_coverage.py tests/test_support_versions.py \
  -k "fresh or targets or versions" "$@"
