#!/usr/bin/env bash
# Run HERE (CPU machine) before a device session for stages 2 and 4 of run_all.sh (compile, hybrid kernels): fetch
# the wheels the GPU image lacks or has older into .whl/
# (ignored by git, carried by the device tool; together with the working tree under the 64 MiB a call carries).
# The image (2026-11) has torch 2.11, transformers 5.17, accelerate 1.15, huggingface_hub 1.33, tokenizers 0.23.2,
# pyarrow, pandas; not trl, datasets (+ multiprocess, dill), mistral-common (the embedded tokenizer), gguf.
# Brought current to what the CPU suite runs: transformers 5.24.0, accelerate 1.16.0, trl 1.16.0, datasets 5.2.0.
set -euo pipefail
cd "$(dirname "$0")/../.."
EXCLUDE=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"
WHEELS=(
  transformers==5.24.0 accelerate==1.16.0 trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19 dill==0.4.1
  mistral-common==1.13.1 gguf==0.19.0 'fsspec<=2026.9.0'
  # the stateful layers' kernels (run_stateful_check.sh): flash-linear-attention is pure Python (Triton)
  fla-core==0.6.0 flash-linear-attention==0.6.0 einops==0.8.2 ninja==1.13.2
)
# causal-conv1d and mamba-ssm ship as sources only: carried as sdists, built on the GPU machine (nvcc) when time allows
SDISTS=(causal-conv1d==1.7.0 mamba-ssm==2.3.2.post1)
if [[ "${1:-}" == "--list" ]]; then printf '%s\n' "${WHEELS[@]}" "${SDISTS[@]}"; exit 0; fi
rm -rf .whl && mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${WHEELS[@]}"
# their metadata step wants torch and no CUDA build here: the project venv's pip, the CUDA build skipped
CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE .venv/bin/python -m pip download --no-deps \
  --no-build-isolation --no-binary=:all: -d .whl "${SDISTS[@]}"
du -sh .whl
echo 'optional, the real Gemma 3 270M: bash benchmarks/gpu/stage_gemma.sh (prints the staging calls)'
echo "then, for stages 2 and 4: run(command=\"STAGES='2 4' bash benchmarks/gpu/run_all.sh\", carry=[\".whl\"], timeout_s=540)"
echo '(the end-to-end benches, the seed experiment, the long row and FA4: stage_wheels.sh and docs/gpu.md "How to run")'
