#!/usr/bin/env bash
# The GPU run book: from the repository root on the lent GPU machine. docs/gpu.md ("How to run") has the two calls
# that fit one 15-minute device window (the machine's start, both calls and its idle time together; back to back so
# that the machine stays up between them):
#   call 1: run(command="STAGES='fa4stash seed 5 alpaca' DEADLINE_S=290 bash benchmarks/gpu/run_all.sh",
#               carry=[".stage/common", ".stage/fa4-1"], timeout_s=320)
#   call 2: run(command="STAGES='fa4 1 sharegpt' DEADLINE_S=430 bash benchmarks/gpu/run_all.sh",
#               carry=[".stage/common", ".stage/fa4-2"], timeout_s=460)   then give_back()
# Before them, HERE: bash benchmarks/gpu/stage_wheels.sh (writes .stage/: the wheels the image lacks, FA4 in 2 parts).
# Stages, each with its own timeout (seconds, capped by DEADLINE_S), results in $OUT (tables on stdout):
#   fa4stash  keep FA4 part 1 on the machine for the next call (benchmarks/gpu/fa4_install.sh stash)
#   fa4       join, check and unpack FA4 (parts 1 + 2) into /tmp/site; without it the benches use the next kernel
#   seed      the seed's experiment: Mistral-7B shape, Alpaca-template rows, batch 4, 100 steps, checkpointing,
#             padded vs pf-trl on the same rows (e2e_bench.py --preset seed7b) (240)
#   alpaca    end-to-end bench, ~1.1B Llama, Alpaca-template rows: TRL padded / pf-trl / TRL padding_free, with
#             the time call 1 has left (150)
#   sharegpt  end-to-end bench, ~1.1B Llama, ShareGPT multi-turn rows: every arm once, then the four main arms
#             (TRL padded, pf-trl, TRL padding_free sdpa and best attention) again in rotated order (to the deadline)
#   1. attention kernel table: flash_attn (FA4 when installed) vs the float32 reference, kernel times (100; the
#      other backends were measured before: benchmarks/results/gpu_h200_attention_check.json)
#   1b. attention sinks (gpt-oss): every backend with sinks vs the exact reference (100)
#   2. torch.compile on/off through PaddingFreeSFTTrainer: real Gemma 3 270M when staged, else the tiny Llama (200)
#   4. hybrid / state-space layers: the kernels transformers calls, given pf-trl's boundaries (150 + 120; needs the
#      wheels of prepare_carry.sh: run(command="bash benchmarks/gpu/run_stateful_check.sh", carry=[".whl"]))
#   5. long row: one 131,072-token packed row of the ~1B Llama, same segments every step, 1 warm-up + 3 timed
#      steps, per-step MFU (150)
# `--dry-run`: the stages on CPU with tiny sizes, no wheels (tests/test_gpu_runbook.py runs it).
# STAGES="..." runs those stages only, in that order; DEADLINE_S (default 560) ends the last stages early so the
# call ends inside its limit. Logs are packed into logs.tgz after each stage (at most 8 files come back from $OUT).
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0; [[ "${1:-}" == "--dry-run" ]] && DRY=1
STAGES=" ${STAGES:-fa4stash seed 5 alpaca} "
DEADLINE_S=${DEADLINE_S:-560}
export OUT="${OUT:-$PWD/benchmark_outputs}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PF_TRL_CACHE=/tmp/pf-cache
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
WHEELS=$(ls .stage/common/*.whl .whl/*.whl 2>/dev/null)
if [[ $DRY == 0 && -n "$WHEELS" ]]; then
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS || exit 1
  # the CuTe DSL's own packages: its wheel adds them with a .pth file, which Python reads only in site directories
  export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}"
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
"$PY" -c "import trl, datasets; print('trl', trl.__version__, 'datasets', datasets.__version__)" || echo "trl/datasets missing: the training stages will fail (stage_wheels.sh)"
E2E=(benchmarks/gpu/e2e_bench.py --out "$OUT"); [[ $DRY == 1 ]] && E2E+=(--dry-run)

s_fa4stash() {
  stage "fa4stash: FA4 part 1 kept for the next call"
  [[ $DRY == 1 ]] && { echo "dry run: nothing to stash"; return 0; }
  bash benchmarks/gpu/fa4_install.sh stash
}
s_fa4() {
  stage "fa4: join, check, unpack FA4"
  [[ $DRY == 1 ]] && { echo "dry run: nothing to install"; return 0; }
  SITE=/tmp/site timeout "$(left 120)" bash benchmarks/gpu/fa4_install.sh install 2>&1 | tee "$OUT/fa4_install.log"
}
s_seed() {
  stage "seed: Mistral-7B shape, padded vs pf-trl on the same rows"
  timeout "$(left 240)" "$PY" "${E2E[@]}" --preset seed7b 2>&1 | grep -v "Warning\|warn(\|^{'" \
    | tee "$OUT/seed7b.log" | tail -8
}
s_alpaca() {
  stage "alpaca: end-to-end bench, Alpaca-template rows"
  timeout "$(left 170)" "$PY" "${E2E[@]}" --datasets alpaca_template --deadline-s "$(( $(left 170) - 30 ))" 2>&1 \
    | grep -v "Warning\|warn(\|^{'" | tee "$OUT/e2e_alpaca.log" | tail -8
}
s_sharegpt() {
  stage "sharegpt: end-to-end bench, ShareGPT multi-turn rows, every arm"
  local t; t=$(left 480)
  timeout "$t" "$PY" "${E2E[@]}" --datasets sharegpt_multiturn --deadline-s "$(( t - 45 ))" \
    --repeat-arms trl-padded,pf-trl,trl-pf-sdpa,trl-pf-best 2>&1 \
    | grep -v "Warning\|warn(\|^{'" | tee "$OUT/e2e_sharegpt.log" | tail -14
}
s_1() {
  stage "1. attention kernel table"
  if [[ $DRY == 1 ]]; then
    timeout 150 "$PY" benchmarks/gpu/attention_check.py --out "$OUT" --dry-run 2>&1 | tee "$OUT/attention_check.log" | tail -25
  else  # torch_varlen / flex were measured before (benchmarks/results/gpu_h200_attention_check.json): FA4 and the reference
    CHECK_TIMEOUT_S=$(left 100) bash benchmarks/gpu/run_attention_check.sh --backends flash_attn --no-model-check \
      2>&1 | tail -30
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
from pf_trl.batching.collator import PaddingFreeCollator
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
    timeout "$(left 150)" "$PY" benchmarks/gpu/long_row.py --out "$OUT" 2>&1 | grep -v "^{'" | tail -8
  fi
}

for s in $STAGES; do
  if ! declare -F "s_$s" > /dev/null; then echo "run_all.sh: unknown stage '$s'" >&2; exit 2; fi
  if want "$s"; then "s_$s"; pack; else echo; echo "== stage $s skipped (past the deadline)"; fi
done
stage "done"
ls -la "$OUT"
