#!/usr/bin/env bash
# Stage 4 of run_all.sh: the hybrid / state-space layers on the GPU, kernels path vs each example alone.
# flash-linear-attention (+ einops, ninja) come as wheels in .whl/ (run_all.sh installs them); causal-conv1d and
# mamba-ssm come as sources (prepare_carry.sh) and are built here when nvcc exists, each within its own time limit
# (BUILD_TIMEOUT_S, default 150 s; mamba-ssm's Mamba-1 scan takes longer: only with PF_TRL_BUILD_MAMBA=1). A
# family whose kernels are missing is reported as such and checked on pf-trl's segments path.
# Each family runs in a process of its own, stopped after FAMILY_TIMEOUT_S (default 75 s: the first Triton
# compilations of flash-linear-attention take long), and its row is printed and saved as soon as it is known.
# `--dry-run`: CPU, three families, segments path only.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
OUT="${OUT:-$PWD/benchmark_outputs}"
mkdir -p "$OUT"
if [[ "${1:-}" == "--dry-run" ]]; then
  exec timeout "${CHECK_TIMEOUT_S:-150}" "$PY" benchmarks/gpu/stateful_check.py --dry-run --out "$OUT"
fi
SITE=/tmp/site-kernels
mkdir -p "$SITE"
build() {  # build <sdist glob> <env...>: a CUDA build for the H100/H200 arch only
  local sdist
  sdist=$(ls $1 2>/dev/null | head -1)
  [[ -n "$sdist" ]] || { echo "$1 not carried (prepare_carry.sh)"; return 1; }
  shift
  env "$@" TORCH_CUDA_ARCH_LIST="9.0" MAX_JOBS="$(nproc)" timeout "${BUILD_TIMEOUT_S:-150}" \
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" "$sdist"
}
if command -v nvcc >/dev/null; then
  build ".whl/causal_conv1d-*.tar.gz" CAUSAL_CONV1D_FORCE_BUILD=TRUE \
    || echo "causal-conv1d: not built (its layers use pf-trl's segments path)"
  if [[ "${PF_TRL_BUILD_MAMBA:-0}" == 1 ]]; then
    build ".whl/mamba_ssm-*.tar.gz" MAMBA_FORCE_BUILD=TRUE || echo "mamba-ssm: not built"
  fi
else
  echo "no nvcc: causal-conv1d / mamba-ssm not built (their layers use pf-trl's segments path)"
fi
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" timeout "${CHECK_TIMEOUT_S:-120}" \
  "$PY" benchmarks/gpu/stateful_check.py --out "$OUT" --isolate "${FAMILY_TIMEOUT_S:-75}"
