#!/usr/bin/env bash
# Run HERE (CPU machine) before a device session: fetch the wheels the GPU image lacks into .whl/
# (ignored by git, carried by the device tool). The image has torch, transformers, accelerate, pyarrow,
# pandas, tokenizers; not trl, datasets (+ multiprocess, dill), mistral-common (the embedded tokenizer).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19 dill==0.4.1 mistral-common==1.13.1 \
  'fsspec<=2026.9.0'
du -sh .whl
echo 'now: run(command="bash benchmarks/gpu/run_all.sh", carry=[".whl"], timeout_s=540)'
