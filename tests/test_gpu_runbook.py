"""The GPU run book on CPU: the steady-state bench's arithmetic, and ``run_all.sh --dry-run`` through every stage of
the two device calls (tiny models, float32), its JSON recomputable from the per-step records it holds."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import TrainerControl

from pf_trl.benchmarking.e2e import arm_order, recompute_table
from pf_trl.benchmarking.steady import StepTimer, summarize

ROOT = Path(__file__).resolve().parents[1]


class _Meter:
    def __init__(self):
        self.totals = dict(real=0, supervised=0, processed=0, sum_sq=0.0, examples=0)


def test_summary_is_the_documented_formula():
    """MFU = (6 P T + 7 layers hidden sum L^2) / s / peak over the timed steps only; warm-up excluded."""
    steps = [dict(seconds=100.0, real=1, supervised=1, processed=1, sum_sq=1.0, examples=1),  # warm-up: ignored
             dict(seconds=2.0, real=1000, supervised=400, processed=1600, sum_sq=500_000.0, examples=2),
             dict(seconds=2.0, real=1000, supervised=600, processed=1400, sum_sq=500_000.0, examples=2)]
    rec = {"warmup_steps": 1, "steps": steps, "gpu_memory_bytes": {"max_memory_allocated": 2**31,
                                                                   "max_memory_reserved": 3 * 2**30}}
    s = summarize(rec, flop_params=(10**9, 4, 1024), peak_tflops=1000.0)
    flops = 6 * 10**9 * 2000 + 7 * 4 * 1024 * 1_000_000
    assert s["real_tokens_per_second"] == 500.0 and s["supervised_tokens_per_second"] == 250.0
    assert s["padding_share"] == round(1 - 2000 / 3000, 4)
    assert s["mfu"] == round(flops / 4.0 / 1e15, 4)
    assert s["gpu_max_allocated_gb"] == 2.0 and s["gpu_max_reserved_gb"] == 3.0
    # negative control: counting the warm-up step would change every figure
    assert summarize({**rec, "warmup_steps": 0}, flop_params=(10**9, 4, 1024),
                     peak_tflops=1000.0)["real_tokens_per_second"] != 500.0


def test_step_timer_stops_at_min_steps_or_min_seconds():
    meter = _Meter()
    timer = StepTimer(lambda: meter, warmup_steps=2, min_steps=3, min_seconds=1e9)
    control = TrainerControl()
    for i in range(5):
        timer.on_step_begin(None, None, control)
        meter.totals["real"] += 10 * (i + 1)
        timer.on_step_end(None, None, control)
        assert control.should_training_stop == (i == 4)
    assert [s["real"] for s in timer.steps] == [10, 20, 30, 40, 50]  # per step, not cumulative
    timer = StepTimer(lambda: meter, warmup_steps=1, min_steps=10**6, min_seconds=0.0)
    control = TrainerControl()
    timer.on_step_begin(None, None, control)
    timer.on_step_end(None, None, control)
    assert not control.should_training_stop  # the warm-up step never counts
    timer.on_step_begin(None, None, control)
    timer.on_step_end(None, None, control)
    assert control.should_training_stop


def test_arm_order_rotates_every_position():
    arms = ["a", "b", "c"]
    assert [arm_order(arms, r)[0] for r in range(3)] == ["a", "b", "c"]
    assert arm_order(arms, 1) == ["b", "c", "a"]


@pytest.mark.slow
def test_run_book_dry_run_every_stage(tmp_path):
    """Both device calls' stages, on CPU: every JSON is written, every arm ran (liger: skipped, not installed), and
    each table is what its per-step records give (a tampered record gives another table)."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "DEADLINE_S": "900",
           "STAGES": "fa4stash seed 5 alpaca fa4 1 sharegpt"}  # call 1's stages, then call 2's
    proc = subprocess.run(["bash", "benchmarks/gpu/run_all.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skipped (past the deadline)" not in proc.stdout
    for name in ("e2e_seed7b.json", "e2e_llama1b_alpaca_template.json", "e2e_llama1b_sharegpt_multiturn.json",
                 "long_row.json", "attention_check.json"):
        assert (tmp_path / name).is_file(), f"{name} missing:\n{proc.stdout[-3000:]}"

    seed = json.loads((tmp_path / "e2e_seed7b.json").read_text())
    assert seed["same_tokens"] is True and seed["speedup_runtime"] > 0
    assert {r["arm"] for r in seed["runs"]} == {"trl-padded", "pf-trl"}

    long_row = json.loads((tmp_path / "long_row.json").read_text())
    assert long_row["segments_per_step"] == [len(long_row["segments"])] * (1 + long_row["timed_steps"])
    assert len(long_row["step_mfu"]) == 4

    main_arms = {"trl-padded", "pf-trl", "trl-pf-sdpa", "trl-pf-best"}  # run_all.sh's --repeat-arms
    for ds, arms in (("sharegpt_multiturn", 6), ("alpaca_template", 3)):
        report = json.loads((tmp_path / f"e2e_llama1b_{ds}.json").read_text())
        assert not [r for r in report["runs"] if "error" in r], [r["error"] for r in report["runs"] if "error" in r]
        assert {r["arm"] for r in report["runs"] if "skipped" in r} <= {"pf-trl-liger"}
        assert len(report["table"]) == arms
        assert all(row["repeats"] == (2 if row["arm"] in main_arms else 1) for row in report["table"])
        assert report["versions"]["torch"] and report["datasets"][ds]["sha256"]
        assert recompute_table(report["runs"], [ds]) == report["table"]
        tampered = copy.deepcopy(report["runs"])
        next(r for r in tampered if "steps" in r and "summary" in r)["steps"][-1]["seconds"] *= 10
        assert recompute_table(tampered, [ds]) != report["table"]
        padded = next(row for row in report["table"] if row["arm"] == "trl-padded")
        if ds == "alpaca_template":
            assert padded["padding_share"] > 0  # rows of different lengths padded to the longest
