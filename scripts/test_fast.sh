#!/usr/bin/env bash
# The fast lane: lint + every test not marked slow (no training end to end, no servers, no legacy or real-model
# suite). Minutes on 2 cores; run it while working, and scripts/test.sh (what CI runs) before merging.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null || exit 1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONHASHSEED=0
export PF_TRL_CACHE=${PF_TRL_CACHE:-$PWD/.pf-trl-cache}
status=0
.venv/bin/python -m ruff check pf_trl pf_trl_dev preprocess_service tests benchmarks scripts || status=$?
.venv/bin/python -m pytest -q -m "not slow and not legacy and not real" "$@" || status=$?
exit $status
