#!/usr/bin/env bash
# The GPU run book, one command on the lent GPU machine, from the repository root (< 9.5 min with DEADLINE_S):
#   run(command="STAGES='1 1b 4 5 3' bash benchmarks/gpu/run_all.sh", carry=[".whl"], timeout_s=590)
# Before it, HERE: bash benchmarks/gpu/prepare_carry.sh (the wheels, listed by `prepare_carry.sh --list`), and
# optionally bash benchmarks/gpu/stage_gemma.sh + the staging calls it prints (the real Gemma 3 270M).
# Stages, each with its own timeout (seconds), results in $OUT (tables on stdout):
#   1. attention kernel table: every varlen backend vs the exact reference in bf16, kernel times (150)
#   1b. attention sinks (gpt-oss): every backend with sinks vs the exact reference, full and sliding window, forward
#      and gradients; a tiny gpt-oss packed vs padded eager per backend (100)
#   2. torch.compile on/off through PaddingFreeSFTTrainer, both padding-free modes: real Gemma 3 270M when staged,
#      else the tiny Llama; compile time apart, 0-graph-break check of the forward on CUDA (200)
#   3. pf-trl bench: ~1B Llama, padded vs TRL padding-free vs pf-trl, MFU (100)
#   4. hybrid / state-space layers (Qwen3.5, Granite 4.0-H, Mamba2, LFM2...): the kernels transformers calls, given
#      pf-trl's boundaries, vs each example alone vs pf-trl's segments path (builds causal-conv1d first: 150 + 120);
#      alone: run(command="bash benchmarks/gpu/run_stateful_check.sh", carry=[".whl"], timeout_s=300)
#   5. long row: one 131,072-token packed row of the ~1B Llama (segments 4k-64k), varlen backend auto (flash-attn
#      when carried, else PyTorch's varlen / flex), peak memory and tokens/s of an optimizer step (100)
# `--dry-run`: the same stages on CPU with tiny sizes (checks the script, no GPU, no carried wheels needed).
# STAGES="1 1b 4 5 3" runs those stages only, in that order (default: all, in the order above); DEADLINE_S (default
# 560) ends the last stages early so the call ends inside its limit. Logs and plots are packed into logs.tgz after
# each stage: with one JSON per stage, no more than 8 files come back from $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0; [[ "${1:-}" == "--dry-run" ]] && DRY=1
STAGES=" ${STAGES:-1 1b 2 3 4 5} "
DEADLINE_S=${DEADLINE_S:-560}
export OUT="${OUT:-$PWD/benchmark_outputs}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PF_TRL_CACHE=/tmp/pf-cache
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if [[ $DRY == 0 && -d .whl ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
T0=$SECONDS
stage() { echo; echo "== [$((SECONDS - T0)) s] $*"; }
want() { [[ "$STAGES" == *" $1 "* ]] && (( SECONDS < DEADLINE_S - 20 )); }
left() { local t=$((DEADLINE_S - SECONDS)); (( t < $1 )) && echo "$t" || echo "$1"; }  # a stage's timeout, capped
pack() {  # every log, plot and folder into logs.tgz (added to it), so that one JSON per stage + logs.tgz come back
  (cd "$OUT" || exit 0; shopt -s nullglob; files=(./*.log ./*.png ./*/); (( ${#files[@]} )) || exit 0
   if [[ -f logs.tgz ]]; then gunzip -c logs.tgz > logs.tar; fi
   tar rf logs.tar "${files[@]}" && gzip -c logs.tar > logs.tgz && rm -rf logs.tar "${files[@]}") || true
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$PY" -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'cuda', torch.cuda.is_available())"
"$PY" -c "import trl, datasets; print('trl', trl.__version__, 'datasets', datasets.__version__)" || echo "trl/datasets missing: stages 2-3 will fail (prepare_carry.sh)"

s_1() {
  stage "1. attention kernel table"
  if [[ $DRY == 1 ]]; then
    timeout 150 "$PY" benchmarks/gpu/attention_check.py --out "$OUT" --dry-run 2>&1 | tee "$OUT/attention_check.log" | tail -25
  else
    CHECK_TIMEOUT_S=$(left 150) bash benchmarks/gpu/run_attention_check.sh 2>&1 | tail -40
  fi
}
s_1b() {
  stage "1b. attention sinks (gpt-oss)"
  timeout "$(left 100)" "$PY" benchmarks/gpu/sinks_check.py --out "$OUT" $([[ $DRY == 1 ]] && echo --dry-run) 2>&1 \
    | grep -v "Warning\|warn(" | tee "$OUT/sinks_check.log" | tail -14
}
s_2() {
  stage "2. torch.compile on/off (PaddingFreeSFTTrainer, both modes)"
  "$PY" - <<'PY' 2>&1 | tee "$OUT/compile_explain.log"
# 0 graph breaks in the model forward on this device (the CPU test does the same on CPU)
import torch
from pf_trl.attention import enable_padding_free
from pf_trl.collator import PaddingFreeCollator
from pf_trl.models import build_model
dev = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if dev == "cuda" else torch.float32
for mode in ("internal", "huggingface"):
    m = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", num_hidden_layers=2).to(dev, dtype)
    enable_padding_free(m, mode=mode)
    b = PaddingFreeCollator()([{"input_ids": list(range(5, 5 + n))} for n in (70, 130, 33)])
    b = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
    torch._dynamo.reset()
    ex = torch._dynamo.explain(m)(**b)
    print(f"{mode}: graphs {ex.graph_count}, graph breaks {ex.graph_break_count}",
          [r.reason.splitlines()[0] for r in ex.break_reasons])
PY
  GGUF=/tmp/gemma/gemma-3-270m-q4_k_m.gguf
  if [[ $DRY == 1 ]]; then
    timeout 200 "$PY" benchmarks/compile_bench.py --dry-run --modes internal --out "$OUT" 2>&1 | grep -v "^{'" | tail -12
  elif [[ -f /tmp/gemma/SHA256SUM ]] && (cd /tmp/gemma && cat part-* > "$(basename $GGUF)" && sha256sum -c SHA256SUM); then
    timeout 200 "$PY" benchmarks/compile_bench.py --model gemma3-270m --gguf "$GGUF" --examples 96 --max-len 1024 \
      --batch-size 16 --out "$OUT" 2>&1 | grep -v "^{'" | tail -12
  else
    echo "Gemma 3 270M not staged in /tmp/gemma (stage_gemma.sh): compile on/off on the tiny Llama instead"
    timeout 200 "$PY" benchmarks/compile_bench.py --model pf-trl/tiny-llama --examples 128 --max-len 1024 \
      --batch-size 16 --out "$OUT" 2>&1 | grep -v "^{'" | tail -12
  fi
}
s_3() {
  stage "3. pf-trl bench"
  if [[ $DRY == 1 ]]; then
    timeout 150 "$PY" -m pf_trl.cli.main bench benchmarks/scenarios/tiny_test.yaml --modes pf-trl --examples 8 \
      --output-dir "$OUT" --timeout 140 2>&1 | tee "$OUT/bench.log" | tail -15
  else
    timeout "$(left 300)" "$PY" -m pf_trl.cli.main bench benchmarks/scenarios/gpu_llama1b.yaml --examples 120 --output-dir "$OUT" \
      --timeout 90 2>&1 | tee "$OUT/bench.log" | tail -30
  fi
}
s_4() {
  stage "4. hybrid / state-space layers: kernels path vs each example alone"
  if [[ $DRY == 1 ]]; then
    bash benchmarks/gpu/run_stateful_check.sh --dry-run 2>&1 | tee "$OUT/stateful_check.log" | tail -8
  else
    BUILD_TIMEOUT_S=$(left 100) CHECK_TIMEOUT_S=120 bash benchmarks/gpu/run_stateful_check.sh 2>&1 | tee "$OUT/stateful_check.log" | tail -20
  fi
}
s_5() {
  stage "5. one 128k-token packed row, ~1B Llama"
  if [[ $DRY == 1 ]]; then
    timeout 300 "$PY" benchmarks/gpu/long_row.py --dry-run --out "$OUT" 2>&1 | grep -v "^{'" | tail -5
  else
    timeout "$(left 100)" "$PY" benchmarks/gpu/long_row.py --out "$OUT" 2>&1 | grep -v "^{'" | tail -8
  fi
}

for s in $STAGES; do
  if want "$s"; then "s_$s"; pack; else echo; echo "== stage $s skipped (not asked for, or past the deadline)"; fi
done
stage "done"
ls -la "$OUT"
