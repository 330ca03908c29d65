#!/usr/bin/env bash
# Runner for the H200 attention check (image: torch 2.11 / CUDA 13, transformers 5.17, triton 3.6, no flash-attn).
# Usage (repository root on the device machine):  bash benchmarks/gpu/run_attention_check.sh [extra args]
# Results: table on stdout, $OUT/attention_check.json. Expected wall time: ~2-4 min (flex compiles fwd+bwd once).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OUT="${OUT:-$PWD/benchmark_outputs}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
# a stuck compile must not eat the whole device budget
timeout "${CHECK_TIMEOUT_S:-480}" "$PY" benchmarks/gpu/attention_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/attention_check.log"
