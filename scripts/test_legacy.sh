#!/usr/bin/env bash
# Run the `internal` padding-free path against transformers 4.43.4 (the last release without native packed
# sequences), on CPU, with the exact `sdpa` varlen backend.
#
# Creates .venv-legacy on first use (about 30-60 s from the local wheel cache + PyPI), then runs
# `pytest -m legacy tests/test_attention_legacy.py` in it. Extra arguments go to pytest; `--prepare` alone only
# creates the venv (scripts/test.sh does that in the background while the main suite runs).
#   PF_LEGACY_VENV  venv path (default .venv-legacy)
#   PYTHON          interpreter for the venv (default python3; needs 3.10-3.12 for tokenizers 0.19 wheels)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${PF_LEGACY_VENV:-.venv-legacy}"
PY="${PYTHON:-python3}"
TRANSFORMERS_VERSION=4.43.4
# torch first, CPU build: the +cpu local version only exists in the local wheel cache (pip find-links), never
# on PyPI, so this can never pull a multi-GB CUDA build.
TORCH_SPEC="torch==2.13.0+cpu"
# transformers 4.43.4 pins tokenizers<0.20; 0.19.1 ships cp311 wheels (no Rust build).
PINS=("transformers==${TRANSFORMERS_VERSION}" "tokenizers==0.19.1" "huggingface_hub<1.0" "pytest>=8")

venv_ok() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<PYEOF 2>/dev/null
import torch, transformers, pf_trl
assert transformers.__version__ == "${TRANSFORMERS_VERSION}", transformers.__version__
assert torch.version.cuda is None, "CUDA torch in the legacy venv"
PYEOF
}

if ! venv_ok; then
  start=$(date +%s)
  echo "[test_legacy] creating $VENV (torch CPU + transformers ${TRANSFORMERS_VERSION})"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
  if ! "${PIP[@]}" "$TORCH_SPEC"; then
    echo "[test_legacy] could not install $TORCH_SPEC: the CPU torch wheel must be in pip's find-links" >&2
    echo "[test_legacy] (refusing to fall back to a CUDA torch from PyPI)" >&2
    exit 1
  fi
  "${PIP[@]}" "${PINS[@]}" "$TORCH_SPEC"
  "${PIP[@]}" --no-deps -e .
  venv_ok || { echo "[test_legacy] $VENV is broken after install" >&2; exit 1; }
  echo "[test_legacy] venv ready in $(( $(date +%s) - start )) s"
fi
[[ "${1:-}" == --prepare ]] && exit 0

"$VENV/bin/python" -c "import torch, transformers; print(f'[test_legacy] torch {torch.__version__}, transformers {transformers.__version__}')"
exec "$VENV/bin/python" -m pytest -m legacy tests/test_attention_legacy.py -q -p no:cacheprovider "$@"
