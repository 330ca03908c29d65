#!/usr/bin/env bash
# The GPU run book: from the repository root on the lent GPU machine. docs/gpu.md ("How to run") has the two calls
# that fit one 15-minute device window (the machine's start, both calls, the transfers and the gap between them;
# back to back so that the machine stays up between them), with the budget of every stage:
#   call 1: run(command="STAGES='fa4stash sharegpt seed' DEADLINE_S=440 bash benchmarks/gpu/run_all.sh",
#               carry=[".stage/common", ".stage/fa4-1"], kind="nvidia-h200", timeout_s=465)
#   call 2: run(command="STAGES='sharegpt2 fa4 best 1 5 alpaca extras' DEADLINE_S=190 bash benchmarks/gpu/run_all.sh",
#               carry=[".stage/common", ".stage/fa4-2"], timeout_s=215)   then give_back()
# Before them, HERE: bash benchmarks/gpu/stage_wheels.sh (writes .stage/: the wheels the image lacks, FA4 in 2 parts).
# Stages, most valuable first; each with its own timeout (seconds, capped by DEADLINE_S); every bench writes its
# JSON after each arm, so a stage cut short keeps what it measured; results in $OUT (tables on stdout), each
# stage's seconds in $OUT/stage_seconds.tsv:
#   fa4stash  keep FA4 part 1 on the machine for the next call (benchmarks/gpu/fa4_install.sh stash)
#   sharegpt  the headline: ~1.1B Llama, ShareGPT multi-turn rows, TRL padded / pf-trl / TRL padding_free=True
#             (sdpa), round 1 (120)
#   seed      the seed's experiment: Mistral-7B shape, batch 4, 100 steps over 400 rows, checkpointing: TRL padded,
#             the same batches with the padding removed, pf-trl's token budget (e2e_bench.py --preset seed7b;
#             ShareGPT first turns in an Alpaca-style template, not Alpaca) (to the deadline)
#   sharegpt2 the headline's round 2, arm order rotated (merge: e2e_bench.py --merge A B) (120)
#   then with the time left:
#   fa4       join, check, unpack FA4 (parts 1 + 2) into /tmp/site; without it the benches use the next kernel (40)
#   best      ShareGPT: TRL padding_free with the best attention here (FA4 when installed, else flex), pf-trl's
#             huggingface mode with it (90)
#   1.        attention kernel table: flash_attn (FA4 when installed) vs the float32 reference (45)
#   5.        long row: one 131,072-token packed row of the ~1B Llama, 1 warm-up + 3 timed steps, per-step MFU (80)
#   alpaca    ShareGPT first turns in an Alpaca-style template: TRL padded / pf-trl / TRL padding_free (170)
#   extras    ShareGPT: pf-trl + Liger's fused cross-entropy, pf-trl + torch.compile (100)
#   1b. attention sinks (gpt-oss) (100); 2. torch.compile on/off through the trainer (200); 4. hybrid / state-space
#   kernels (150 + 120; needs prepare_carry.sh's wheels: run(command="bash benchmarks/gpu/run_stateful_check.sh",
#   carry=[".whl"])): run on their own.
# `--dry-run`: the stages on CPU with tiny sizes, no wheels (tests/test_gpu_runbook.py runs it under the real
# DEADLINE_S). STAGES="..." runs those stages only, in that order; DEADLINE_S (default 560) ends the last stages early
# so the call ends inside its limit. Logs are packed into logs.tgz after each stage (at most 8 files come back).
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0; [[ "${1:-}" == "--dry-run" ]] && DRY=1
STAGES=" ${STAGES:-fa4stash sharegpt seed} "  # call 1's
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
T0=0  # stage times from the script's start (SECONDS), as DEADLINE_S counts
stage() { echo; echo "== [$((SECONDS - T0)) s] $*"; }
want() { [[ "$STAGES" == *" $1 "* ]] && (( SECONDS < DEADLINE_S - 20 )); }
# a bench stage's own deadline: its timeout less 15 s (the bench starts no arm that would end after it)
bench_deadline() { local t=$(( $1 - 15 )); (( t > 0 )) && echo "$t" || echo 1; }
left() { local t=$((DEADLINE_S - SECONDS)); (( t < $1 )) && echo "$t" || echo "$1"; }  # a stage's timeout, capped
pack() {  # every log, plot and folder into logs.tgz (added to it), so that one JSON per stage + logs.tgz come back
  (cd "$OUT" || exit 0; shopt -s nullglob; files=(./*.log ./*.png ./*/); (( ${#files[@]} )) || exit 0
   if [[ -f logs.tgz ]]; then gunzip -c logs.tgz > logs.tar; fi
   tar rf logs.tar "${files[@]}" && gzip -c logs.tar > logs.tgz && rm -rf logs.tar "${files[@]}") || true
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
# the versions, in one interpreter (each start imports torch: seconds on a CPU)
"$PY" - <<'PY'
import torch, transformers, accelerate
print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__,
      'cuda', torch.cuda.is_available())
try:
    import trl, datasets
except ImportError:
    print("trl/datasets missing: the training stages will fail (stage_wheels.sh)")
else:
    print('trl', trl.__version__, 'datasets', datasets.__version__)
PY
E2E=(benchmarks/gpu/e2e_bench.py --out "$OUT"); [[ $DRY == 1 ]] && E2E+=(--dry-run)
printf 'setup\t%s\n' "$SECONDS" > "$OUT/stage_seconds.tsv"  # wheels and version checks; then one line per stage

s_fa4stash() {
  stage "fa4stash: FA4 part 1 kept for the next call"
  [[ $DRY == 1 ]] && { echo "dry run: nothing to stash"; return 0; }
  bash benchmarks/gpu/fa4_install.sh stash
}
s_fa4() {
  stage "fa4: join, check, unpack FA4"
  [[ $DRY == 1 ]] && { echo "dry run: nothing to install"; return 0; }
  SITE=/tmp/site timeout "$(left 40)" bash benchmarks/gpu/fa4_install.sh install 2>&1 | tee "$OUT/fa4_install.log"
}
HEADLINE=trl-padded,pf-trl,trl-pf-sdpa
s_sharegpt() {
  stage "sharegpt: the headline, ShareGPT multi-turn rows, round 1"
  local t; t=$(left 120)
  timeout "$t" "$PY" "${E2E[@]}" --datasets sharegpt_multiturn --arms "$HEADLINE" --repeats 1 --min-seconds 10 \
    --deadline-s "$(bench_deadline "$t")" 2>&1 | grep -v "Warning\|warn(\|^{'" | tee "$OUT/e2e_sharegpt.log" | tail -8
}
s_seed() {
  stage "seed: Mistral-7B shape, padded vs the same batches padding-free vs pf-trl's token budget"
  local t; t=$(left 600)
  timeout "$t" "$PY" "${E2E[@]}" --preset seed7b --deadline-s "$(bench_deadline "$t")" 2>&1 \
    | grep -v "Warning\|warn(\|^{'" | tee "$OUT/seed7b.log" | tail -9
}
s_sharegpt2() {
  stage "sharegpt2: the headline's round 2, arm order rotated"
  local t; t=$(left 120)
  timeout "$t" "$PY" "${E2E[@]}" --datasets sharegpt_multiturn --arms "$HEADLINE" --repeats 1 --round-offset 1 \
    --min-seconds 10 --deadline-s "$(bench_deadline "$t")" 2>&1 | grep -v "Warning\|warn(\|^{'" \
    | tee "$OUT/e2e_sharegpt2.log" | tail -8
}
s_best() {
  stage "best: ShareGPT, the best attention here (FA4 when installed)"
  local t; t=$(left 90)
  timeout "$t" "$PY" "${E2E[@]}" --datasets sharegpt_multiturn --arms trl-pf-best,pf-trl-hf --repeats 1 --tag best \
    --min-seconds 10 --deadline-s "$(bench_deadline "$t")" 2>&1 | grep -v "Warning\|warn(\|^{'" \
    | tee "$OUT/e2e_best.log" | tail -8
}
s_extras() {
  stage "extras: ShareGPT, pf-trl + Liger, pf-trl + torch.compile"
  local t; t=$(left 100)
  timeout "$t" "$PY" "${E2E[@]}" --datasets sharegpt_multiturn --arms pf-trl-liger,pf-trl-compile --repeats 1 \
    --tag extras --min-seconds 10 --deadline-s "$(bench_deadline "$t")" 2>&1 | grep -v "Warning\|warn(\|^{'" \
    | tee "$OUT/e2e_extras.log" | tail -8
}
s_alpaca() {
  stage "alpaca: end-to-end bench, ShareGPT first turns in an Alpaca-style template"
  local t; t=$(left 170)
  timeout "$t" "$PY" "${E2E[@]}" --datasets alpaca_template --arms "$HEADLINE" --repeats 1 --min-seconds 10 \
    --deadline-s "$(bench_deadline "$t")" 2>&1 | grep -v "Warning\|warn(\|^{'" | tee "$OUT/e2e_alpaca.log" | tail -8
}
s_1() {
  stage "1. attention kernel table"
  if [[ $DRY == 1 ]]; then
    timeout "$(left 150)" "$PY" benchmarks/gpu/attention_check.py --out "$OUT" --dry-run 2>&1 | tee "$OUT/attention_check.log" | tail -25
  else  # torch_varlen / flex were measured before (benchmarks/results/gpu_h200_attention_check.json): FA4 and the reference
    CHECK_TIMEOUT_S=$(left 45) bash benchmarks/gpu/run_attention_check.sh --backends flash_attn --no-model-check \
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
    timeout "$(left 300)" "$PY" benchmarks/gpu/long_row.py --dry-run --out "$OUT" 2>&1 | grep -v "^{'" | tail -5
  else
    timeout "$(left 80)" "$PY" benchmarks/gpu/long_row.py --out "$OUT" 2>&1 | grep -v "^{'" | tail -8
  fi
}

for s in $STAGES; do
  if ! declare -F "s_$s" > /dev/null; then echo "run_all.sh: unknown stage '$s'" >&2; exit 2; fi
  if want "$s"; then
    t_stage=$SECONDS; "s_$s"; pack; printf '%s\t%s\n' "$s" "$((SECONDS - t_stage))" >> "$OUT/stage_seconds.tsv"
  else echo; echo "== stage $s skipped (past the deadline)"; printf '%s\tskipped\n' "$s" >> "$OUT/stage_seconds.tsv"; fi
done
stage "done"
ls -la "$OUT"
