#!/usr/bin/env bash
# The fast lane: lint + every test not marked slow (no training end to end, no servers, no legacy or real-model
# suite), on every core (pytest-xdist). About 2.5 minutes on 2 cores; run it while working, and scripts/test.sh (what
# CI runs) before merging. PF_TRL_TEST_WORKERS sets the number of workers; extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null || exit 1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONHASHSEED=0
export PF_TRL_CACHE=${PF_TRL_CACHE:-$PWD/.pf-trl-cache}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one process per core: see scripts/test.sh
workers=${PF_TRL_TEST_WORKERS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2)}
(( workers > 8 )) && workers=8
status=0
.venv/bin/python -m ruff check pf_trl pf_trl_dev preprocess_service tests benchmarks scripts || status=$?
.venv/bin/python -m pytest -q -n "$workers" --dist loadgroup --durations=25 -m "not slow and not legacy and not real" "$@" \
  || status=$?
exit $status
