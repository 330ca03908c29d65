"""The GPU run book's device budget: its two calls, and each stage's seconds estimated from a CPU dry run.

One 15-minute device window holds the machine's start, both calls (``benchmarks/gpu/run_all.sh``), the transfers,
the gap between the calls and the hand-back. :data:`CALLS` is the plan (run_all.sh's header and docs/gpu.md quote
it; a test checks that they agree). :func:`budget_table` estimates every stage on the GPU from what a CPU dry run
measured (``run_all.sh --dry-run`` under the same ``DEADLINE_S``) and what the GPU's steps should cost:

- host seconds (measured, CPU): the stage's dry-run seconds less the seconds of its training steps (process start,
  imports, building trainers and data); a 16-core GPU host does this no slower than this 2-core machine;
- GPU seconds (estimated): per arm, the model's build and first-step allocation (:data:`BUILD_S`, assumed) plus
  the steps the real run takes, each ``hardware FLOPs / ACHIEVED_TFLOPS`` plus AdamW's pass over its states, from
  the lengths of the rows it trains on (the padded arms' padding and dense masks included).

Nothing here has run on a GPU: the rates and start-up times are assumptions, named in the table, and the first
real call's ``stage_seconds.tsv`` replaces them.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WINDOW_S = 900.0  # the device time of one session
START_S = 120.0  # the machine's start ("a minute or more"), assumed at two minutes
TRANSFER_S = 15.0  # per call: the tree and ~62 MB of carried wheels up, the results back (assumed)
GAP_S = 30.0  # between the two calls, the machine held warm (assumed)
GIVE_BACK_S = 5.0
CALL_SETUP_S = 20.0  # pip-installing .stage/common into /tmp/site at each call's start (assumed; the dry run skips it)
PEAK_TFLOPS = 989.0  # H100 / H200 dense bf16 (datasheet)
ACHIEVED_FRACTION = 0.40  # hardware FLOPs reached by a training step (assumed: KINDS.md measured a bf16 matmul at ~80%)
DENSE_MASK_FRACTION = 0.25  # sdpa with a dense 4-D mask (the padded and TRL sdpa padding-free arms' attention)
HBM_BYTES_PER_S = 3.0e12  # measured here on an H100 (KINDS.md; an H200 moved 4.3e12)
ADAMW_BYTES_PER_PARAM = 16  # bf16 weight, gradient and two states: read and written (assumed)
BUILD_S = {"pf-trl/llama-1b": 8.0, "pf-trl/mistral-7b": 25.0}  # random init on the GPU, first step's allocations
# stages that are not training steps: their seconds on the GPU, host part included (assumed; 1: its cap)
FIXED_STAGE_S = {"fa4stash": 3.0, "fa4": 30.0, "1": 45.0}


@dataclass(frozen=True)
class Call:
    """One device call of the run book."""

    stages: tuple[str, ...]
    deadline_s: int  # run_all.sh's DEADLINE_S: no stage starts within 20 s of it, each stage's timeout capped by it
    timeout_s: int  # the run tool's limit for the call
    carry: tuple[str, ...]
    kind: str | None = None

    def command(self) -> str:
        return f"STAGES='{' '.join(self.stages)}' DEADLINE_S={self.deadline_s} bash benchmarks/gpu/run_all.sh"


CALLS = (
    Call(("fa4stash", "sharegpt", "seed"), 440, 465, (".stage/common", ".stage/fa4-1"), kind="nvidia-h200"),
    Call(("sharegpt2", "fa4", "best", "1", "5", "alpaca", "extras"), 190, 215, (".stage/common", ".stage/fa4-2")),
)
# stages that run with the time left, in order: the deadline may cut them without losing a planned figure (the
# planned ones: the headline's two rounds and the seed's experiment)
FILLER_STAGES = ("fa4", "best", "1", "5", "alpaca", "extras")

# what each bench stage trains: (model, dataset, arms, rows, batch, timed-steps cap, seconds cap, checkpointing)
BENCH_STAGES: dict[str, dict[str, Any]] = {
    "sharegpt": dict(model="pf-trl/llama-1b", dataset="sharegpt_multiturn",
                     arms=("trl-padded", "pf-trl", "trl-pf-sdpa"),
                     rows=2000, batch=8, steps=100, seconds=10.0, warmup=3, checkpointing=False),
    "sharegpt2": dict(model="pf-trl/llama-1b", dataset="sharegpt_multiturn",
                      arms=("trl-padded", "pf-trl", "trl-pf-sdpa"), rows=2000, batch=8, steps=100, seconds=10.0,
                      warmup=3, checkpointing=False),
    "best": dict(model="pf-trl/llama-1b", dataset="sharegpt_multiturn", arms=("trl-pf-best", "pf-trl-hf"),
                 rows=2000, batch=8, steps=100, seconds=10.0, warmup=3, checkpointing=False),
    "extras": dict(model="pf-trl/llama-1b", dataset="sharegpt_multiturn", arms=("pf-trl-liger", "pf-trl-compile"),
                   rows=2000, batch=8, steps=100, seconds=10.0, warmup=3, checkpointing=False),
    "alpaca": dict(model="pf-trl/llama-1b", dataset="alpaca_template", arms=("trl-padded", "pf-trl", "trl-pf-sdpa"),
                   rows=2000, batch=8, steps=100, seconds=10.0, warmup=3, checkpointing=False),
    "seed": dict(model="pf-trl/mistral-7b", dataset="alpaca_template",
                 arms=("trl-padded", "pf-trl-same-batches", "pf-trl"), rows=400, batch=4, steps=100,
                 seconds=float("inf"), warmup=0, checkpointing=True),
}
# the long row: 131,072 tokens in segments of 4k-64k, 1 warm-up + 3 timed steps, checkpointing
LONG_ROW_SEGMENTS = tuple(k * 1024 for k in (4, 12, 16, 32, 64))
COMPILE_S = 40.0  # pf-trl-compile's compilation on the GPU (assumed)


def flop_params(model: str) -> tuple[int, int, int, int]:
    """(body, head, layers, hidden) of an embedded model, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pf_trl.models import embedded_config
    from pf_trl.trainer.metrics import model_flop_params

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(embedded_config(model))
    return tuple(model_flop_params(m))


def _lengths(dataset: str, rows: int) -> tuple[list[int], list[int]]:
    from pf_trl.benchmarking.rows import load_shapes

    shapes = load_shapes(dataset)["shapes"][:rows]
    return [sum(s) for s in shapes], [sum(s[1::2]) for s in shapes]


def arm_step_seconds(arm: str, model: str, dataset: str, rows: int, batch: int, checkpointing: bool,
                     params: tuple[int, int, int, int] | None = None) -> tuple[float, int]:
    """(expected seconds of one optimizer step on the GPU, steps in one pass over ``rows``) for ``arm``."""
    body, head, layers, hidden = params or flop_params(model)
    lens, sup = _lengths(dataset, rows)
    rate = PEAK_TFLOPS * 1e12 * ACHIEVED_FRACTION
    dense_rate = PEAK_TFLOPS * 1e12 * DENSE_MASK_FRACTION
    matmul = (8.0 if checkpointing else 6.0) * body  # per computed token, checkpointing's second forward included
    causal = (9.0 if checkpointing else 7.0) * layers * hidden  # per squared length: flash-style recompute
    full = 2 * (9.0 if checkpointing else 7.0) * layers * hidden  # the whole square of a dense mask
    batches = [range(i, min(i + batch, len(lens))) for i in range(0, len(lens), batch)]
    seconds = []
    if arm in ("trl-padded", "trl-pf-sdpa"):
        for b in batches:
            bl = [lens[i] for i in b]
            tokens = len(bl) * max(bl) if arm == "trl-padded" else sum(bl)
            squares = len(bl) * max(bl) ** 2 if arm == "trl-padded" else sum(bl) ** 2
            seconds.append((matmul * tokens + 6.0 * head * sum(sup[i] for i in b)) / rate + full * squares / dense_rate)
        steps = len(batches)
    else:  # varlen attention on the real tokens; the token-budget arms pack ~batch x mean length a step
        per_row = [(matmul * n + 6.0 * head * s) / rate + causal * n * n / rate for n, s in zip(lens, sup)]
        steps = len(batches) if arm in ("pf-trl-same-batches", "trl-pf-best", "pf-trl-hf") else max(
            1, math.ceil(sum(lens) / (batch * sum(lens) / len(lens)) / 0.97))
        seconds = [sum(per_row) / steps]
    optimizer = ADAMW_BYTES_PER_PARAM * (body + head) / HBM_BYTES_PER_S
    return sum(seconds) / len(seconds) + optimizer, steps


def long_row_seconds() -> float:
    body, head, layers, hidden = flop_params("pf-trl/llama-1b")
    tokens = sum(LONG_ROW_SEGMENTS)
    hw = 8.0 * body * tokens + 6.0 * head * tokens + 9.0 * layers * hidden * sum(n * n for n in LONG_ROW_SEGMENTS)
    return BUILD_S["pf-trl/llama-1b"] + 4 * hw / (PEAK_TFLOPS * 1e12 * ACHIEVED_FRACTION)


def stage_gpu_seconds(stage: str, params_cache: dict[str, tuple] | None = None) -> float:
    """Expected GPU seconds of a stage's training (builds and steps), not counting the host's part."""
    if stage == "5":
        return long_row_seconds()
    if stage in FIXED_STAGE_S:
        return FIXED_STAGE_S[stage]
    spec = BENCH_STAGES.get(stage)
    if spec is None:
        return 0.0
    cache = params_cache if params_cache is not None else {}
    params = cache.setdefault(spec["model"], flop_params(spec["model"]))
    total = 0.0
    for arm in spec["arms"]:
        step, steps = arm_step_seconds(arm, spec["model"], spec["dataset"], spec["rows"], spec["batch"],
                                       spec["checkpointing"], params)
        if stage == "seed":
            timed = steps
        else:
            timed = min(spec["steps"], math.ceil(spec["seconds"] / step) + 1)
        total += BUILD_S[spec["model"]] + (spec["warmup"] + timed) * step
        total += COMPILE_S if arm == "pf-trl-compile" else 0.0
    return total


def dry_run_host_seconds(out: Path) -> tuple[dict[str, float], float]:
    """From a dry run's ``$OUT/stage_seconds.tsv`` and JSONs: (per stage, its seconds less its training steps'
    seconds), and the seconds before the first stage (version checks)."""
    stage_s: dict[str, float] = {}
    with open(out / "stage_seconds.tsv") as f:
        for name, secs in csv.reader(f, delimiter="\t"):
            stage_s[name] = float("nan") if secs == "skipped" else float(secs)
    steps_s: dict[str, float] = {}
    files = {"sharegpt": "e2e_llama1b_sharegpt_multiturn.json",
             "sharegpt2": "e2e_llama1b_sharegpt_multiturn_round2.json",
             "best": "e2e_llama1b_sharegpt_multiturn_best.json",
             "extras": "e2e_llama1b_sharegpt_multiturn_extras.json", "alpaca": "e2e_llama1b_alpaca_template.json",
             "seed": "e2e_seed7b.json", "5": "long_row.json"}
    for stage, name in files.items():
        path = out / name
        if stage in stage_s and path.is_file():
            runs = json.loads(path.read_text()).get("runs")
            records = runs if runs is not None else [json.loads(path.read_text())]
            steps_s[stage] = sum(s["seconds"] for r in records for s in r.get("steps") or [])
    pre = stage_s.pop("setup", 0.0)
    # a stage the dry run skipped (its deadline) has no host part: None
    return {k: None if math.isnan(v) else max(0.0, v - steps_s.get(k, 0.0)) for k, v in stage_s.items()}, pre


def budget_table(dry_runs: list[Path]) -> dict[str, Any]:
    """The budget of every stage of :data:`CALLS` from their dry runs (one ``$OUT`` per call, in order).

    Per call: the planned stages (not :data:`FILLER_STAGES`) must end before its deadline (``margin_s``); the
    fillers run with the time left. The window: the start, both calls to their deadlines (expected) or to their
    timeouts (worst case), the transfers, the gap and the hand-back, against :data:`WINDOW_S`."""
    cache: dict[str, tuple] = {}
    calls = []
    for i, (call, out) in enumerate(zip(CALLS, dry_runs)):
        host, pre = dry_run_host_seconds(out)
        rows, elapsed = [], CALL_SETUP_S + pre
        for stage in call.stages:
            gpu = stage_gpu_seconds(stage, cache)
            measured = 0.0 if stage in FIXED_STAGE_S else host.get(stage)
            est = (measured or 0.0) + gpu
            elapsed += est
            rows.append({"stage": stage, "gpu_estimate_s": round(gpu, 1),
                         "cpu_dry_run_host_s": None if measured is None else round(measured, 1),
                         "stage_estimate_s": round(est, 1), "ends_at_s": round(elapsed, 1),
                         "filler": stage in FILLER_STAGES, "expected_to_run": elapsed <= call.deadline_s})
        planned = CALL_SETUP_S + pre + sum(r["stage_estimate_s"] for r in rows if not r["filler"])
        calls.append({"call": i + 1, "command": call.command(), "timeout_s": call.timeout_s,
                      "deadline_s": call.deadline_s, "setup_s": round(CALL_SETUP_S + pre, 1), "stages": rows,
                      "planned_estimate_s": round(planned, 1), "margin_s": round(call.deadline_s - planned, 1)})
    fixed = START_S + len(CALLS) * TRANSFER_S + GAP_S + GIVE_BACK_S
    worst = fixed + sum(c.timeout_s for c in CALLS)
    expected = fixed + sum(c.deadline_s + 5 for c in CALLS)  # a call ends at its deadline, then packs its logs
    return {"window_s": WINDOW_S, "calls": calls,
            "window_expected_s": expected, "window_margin_expected_s": WINDOW_S - expected,
            "window_worst_case_s": worst, "window_margin_worst_case_s": WINDOW_S - worst,
            "assumptions": {"start_s": START_S, "transfer_s_per_call": TRANSFER_S, "gap_s": GAP_S,
                            "give_back_s": GIVE_BACK_S, "call_setup_s": CALL_SETUP_S,
                            "achieved_fraction_of_peak": ACHIEVED_FRACTION,
                            "dense_mask_fraction_of_peak": DENSE_MASK_FRACTION, "peak_tflops": PEAK_TFLOPS,
                            "build_s": BUILD_S, "fixed_stage_s": FIXED_STAGE_S, "compile_s": COMPILE_S,
                            "hbm_bytes_per_s": HBM_BYTES_PER_S, "adamw_bytes_per_param": ADAMW_BYTES_PER_PARAM}}


def format_budget(budget: dict[str, Any]) -> str:
    """The budget as a markdown table (docs/gpu.md holds one)."""
    lines = ["| call | stage | CPU dry run, host part (s) | GPU, estimated (s) | stage (s) | ends at (s) | "
             "runs |", "|---|---|---|---|---|---|---|"]
    for c in budget["calls"]:
        lines.append(f"| {c['call']} | setup (wheels, versions) | | | {c['setup_s']} | {c['setup_s']} | yes |")
        for r in c["stages"]:
            name = r["stage"] + (" (with the time left)" if r["filler"] else "")
            runs = "yes" if r["expected_to_run"] else "cut by the deadline"
            host = "skipped in the dry run" if r["cpu_dry_run_host_s"] is None else r["cpu_dry_run_host_s"]
            lines.append(f"| {c['call']} | {name} | {host} | {r['gpu_estimate_s']} | "
                         f"{r['stage_estimate_s']} | {r['ends_at_s']} | {runs} |")
        lines.append(f"| {c['call']} | planned stages, against DEADLINE_S {c['deadline_s']} (timeout "
                     f"{c['timeout_s']}) | | | {c['planned_estimate_s']} | | margin {c['margin_s']} s |")
    lines.append(f"| window | start {START_S:.0f} + both calls + transfers {len(CALLS)} x {TRANSFER_S:.0f} + gap "
                 f"{GAP_S:.0f} + give back {GIVE_BACK_S:.0f} | | | {budget['window_expected_s']:.0f} (calls to their "
                 f"deadlines), {budget['window_worst_case_s']:.0f} (to their timeouts) | of {budget['window_s']:.0f} | "
                 f"margin {budget['window_margin_expected_s']:.0f} s / {budget['window_margin_worst_case_s']:.0f} s |")
    return "\n".join(lines)
