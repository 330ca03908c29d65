#!/usr/bin/env bash
# Run THERE (the lent GPU machine), from the repository root, in one call:
#   1. install the carried wheels (.whl/, from prepare_carry.sh) into /tmp/site;
#   2. the attention check (every backend vs sdpa in bf16, kernel times at 16k/32k tokens);
#   3. `pf-trl bench` on the ~1B Llama scenario (padded vs TRL padding-free vs pf-trl, MFU).
# Everything lands in $OUT (tables on stdout). Budget: ~8 min; each stage has its own timeout.
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT="${OUT:-$PWD/benchmark_outputs}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PF_TRL_CACHE=/tmp/pf-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
python3 -c "import trl, datasets; print('trl', trl.__version__, 'datasets', datasets.__version__)" || echo "trl/datasets missing: bench will fail"

echo "== attention check"
CHECK_TIMEOUT_S=200 bash benchmarks/gpu/run_attention_check.sh 2>&1 | tail -40

echo "== bench (1B Llama, bf16, max_seq_len 4096)"
timeout 300 python3 -m pf_trl.cli.main bench benchmarks/scenarios/gpu_llama1b.yaml --output-dir "$OUT" --timeout 280 2>&1 \
  | tee "$OUT/bench.log" | tail -30
ls -la "$OUT"
