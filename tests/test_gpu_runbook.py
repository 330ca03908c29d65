"""The GPU run book's arithmetic on CPU: model and hardware FLOPs by hand, the steady-state timer (a step's time
includes fetching its batch), the summary, the deadline rule, every flag of ``e2e_bench.py`` honoured or refused,
and the table check failing on a wrong table. The dry run of both device calls is ``test_gpu_runbook_dry_run.py``."""

from __future__ import annotations

import copy
import importlib.util
import time
from pathlib import Path

import pytest
from transformers import TrainerControl

from pf_trl.benchmarking.e2e import _no_time, arm_order, recompute_table
from pf_trl.benchmarking.steady import StepTimer, summarize
from pf_trl.trainer.metrics import FlopParams, hardware_flops, model_flop_params, train_flops

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512)
# the tiny Llama by hand: per layer q 64x64, k and v 64x32 (2 kv heads of 16), o 64x64, gate / up / down 64x128,
# two norms of 64; then the final norm; the head 512 x 64; the input embedding (not counted) 512 x 64
LAYER = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64
BODY, HEAD = 2 * LAYER + 64, 512 * 64


def _tiny(tied: bool):
    from pf_trl.models import build_model

    return build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, tie_word_embeddings=tied, **TINY)


def test_flop_params_by_hand_tied_and_untied():
    assert model_flop_params(_tiny(False)) == FlopParams(BODY, HEAD, 2, 64)
    tied = _tiny(True)
    assert model_flop_params(tied) == FlopParams(BODY, HEAD, 2, 64)  # the shared matrix counted once, as the head
    # negative control: the parameters the model holds are body + head (+ the untied input embedding)
    assert sum(p.numel() for p in tied.parameters()) == BODY + HEAD
    assert sum(p.numel() for p in _tiny(False).parameters()) == BODY + 2 * HEAD


def test_model_and_hardware_flops_by_hand():
    """Two examples of 3 and 5 tokens, 4 of them supervised (the head's positions)."""
    params = FlopParams(BODY, HEAD, 2, 64)
    model = 6 * BODY * 8 + 6 * HEAD * 4 + 6 * 2 * 64 * (3**2 + 5**2)
    assert train_flops(params, 8, 4, 34) == model == 4_366_848
    # activation checkpointing: a second forward of every layer (2 per parameter and token, 2 L d sum L^2), and
    # a flash-style backward recomputing the scores (1 L d sum L^2)
    assert hardware_flops(params, 8, 4, 34, checkpointing=True) == model + 2 * BODY * 8 + 3 * 2 * 64 * 34
    assert hardware_flops(params, 8, 4, 34, checkpointing=False, flash_recompute=False) == model
    assert hardware_flops(params, 8, 4, 34, checkpointing=False) == model + 2 * 64 * 34
    # negative control: the former count (factor 7, the head on every real token) is another number
    assert train_flops(params, 8, 4, 34) != 6 * (BODY + HEAD) * 8 + 7 * 2 * 64 * 34


def test_attention_convention_is_palm_appendix_b_halved_for_the_causal_mask():
    """PaLM (appendix B) and nanoGPT's estimate_mfu: 6 N + 12 L H Q T per token for a sequence of T tokens (H Q =
    hidden), counting the whole T x T score matrix; the causal mask leaves half of it: 6 L d T^2 per sequence."""
    layers, hidden, n, t = 4, 256, 10**6, 1000
    palm = t * (6 * n + 12 * layers * hidden * t)
    ours = train_flops(FlopParams(n, 0, layers, hidden), t, 0, t * t)
    assert ours == palm - 6 * layers * hidden * t * t
    assert ours != palm  # negative control: the masked half is not counted


class _Meter:
    def __init__(self):
        self.totals = dict(real=0, supervised=0, processed=0, sum_sq=0.0, examples=0)


def test_summary_mfu_and_hfu_by_hand():
    """MFU and HFU over the timed steps only (warm-up excluded), the data share from the steps' data_seconds."""
    steps = [dict(seconds=100.0, data_seconds=1.0, real=1, supervised=1, processed=1, sum_sq=1.0, examples=1),
             dict(seconds=2.0, data_seconds=0.5, real=1000, supervised=400, processed=1600, sum_sq=500_000.0,
                  examples=2),
             dict(seconds=2.0, data_seconds=0.5, real=1000, supervised=600, processed=1400, sum_sq=500_000.0,
                  examples=2)]
    rec = {"warmup_steps": 1, "steps": steps, "recompute": {"activation_checkpointing": True, "flash_recompute": True},
           "gpu_memory_bytes": {"max_memory_allocated": 2**31, "max_memory_reserved": 3 * 2**30}}
    params = (10**9, 10**8, 4, 1024)
    s = summarize(rec, flop_params=params, peak_tflops=1000.0)
    model = 6 * 10**9 * 2000 + 6 * 10**8 * 1000 + 6 * 4 * 1024 * 1_000_000
    hardware = model + 2 * 10**9 * 2000 + 3 * 4 * 1024 * 1_000_000
    assert s["mfu"] == round(model / 4.0 / 1e15, 4) and s["hfu"] == round(hardware / 4.0 / 1e15, 4)
    assert s["real_tokens_per_second"] == 500.0 and s["supervised_tokens_per_second"] == 250.0
    assert s["padding_share"] == round(1 - 2000 / 3000, 4) and s["data_seconds_share"] == 0.25
    assert s["gpu_max_allocated_gb"] == 2.0 and s["gpu_max_reserved_gb"] == 3.0
    # negative controls: counting the warm-up step, or no recomputation, changes the figures
    assert summarize({**rec, "warmup_steps": 0}, flop_params=params,
                     peak_tflops=1000.0)["real_tokens_per_second"] != 500.0
    assert summarize({**rec, "recompute": {}}, flop_params=params, peak_tflops=1000.0)["hfu"] == s["mfu"]


def test_step_time_includes_fetching_the_batch():
    """The Trainer fetches and collates a batch before on_step_begin: the timer's step starts at the end of the
    step before, so that time is in the step (and reported alone as data_seconds)."""
    meter = _Meter()
    timer = StepTimer(lambda: meter, warmup_steps=0, min_steps=10, min_seconds=1e9)
    control = TrainerControl()
    timer.on_train_begin(None, None, control)
    for _ in range(2):
        time.sleep(0.05)  # fetching and collating
        timer.on_step_begin(None, None, control)
        time.sleep(0.02)  # forward, backward, optimizer
        timer.on_step_end(None, None, control)
    for step in timer.steps:
        assert step["data_seconds"] >= 0.05 and step["seconds"] >= 0.07
        assert step["seconds"] - step["data_seconds"] < 0.05  # negative control: begin-to-end alone misses it


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


def test_no_arm_starts_that_would_end_after_the_deadline():
    now = time.time()
    assert _no_time(None, [{"wall_s": 1e9}]) is None
    assert _no_time(now + 100, [{"wall_s": 30.0}]) is None  # negative control: time for one more
    assert "longest arm so far took 130 s" in _no_time(now + 100, [{"wall_s": 30.0}, {"wall_s": 130.0}])
    assert _no_time(now - 1, []) == "deadline reached"


# ------------------------------------------------------------------------------------------ the table check


def _run(arm, seconds, real=1000):
    steps = [dict(seconds=seconds, data_seconds=0.0, real=real, supervised=real // 2, processed=real,
                  sum_sq=float(real * 100), examples=4)] * 3
    rec = {"arm": arm, "dataset": "d", "warmup_steps": 1, "steps": steps, "flop_params": [10**6, 10**5, 2, 64],
           "peak_tflops": 1.0, "attn_implementation": "sdpa"}
    rec["summary"] = summarize(rec, flop_params=tuple(rec["flop_params"]), peak_tflops=1.0)
    return rec


def check_table(report: dict) -> None:
    """A table is right when it is what its runs give, and its tokens/s and ratios are what the per-step records
    give by hand (an independent count: a wrong summarize would not pass either)."""
    assert recompute_table(report["runs"], ["d"]) == report["table"]
    by_hand = {}
    for r in report["runs"]:
        timed = r["steps"][r["warmup_steps"]:]
        by_hand[r["arm"]] = sum(s["real"] for s in timed) / sum(s["seconds"] for s in timed)
    for row in report["table"]:
        assert row["real_tokens_per_second"] == pytest.approx(by_hand[row["arm"]], rel=1e-3)
        assert row["ratio_to_padded"] == pytest.approx(by_hand[row["arm"]] / by_hand["trl-padded"], abs=2e-3)


def test_table_check_fails_on_a_wrong_table():
    runs = [_run("trl-padded", 2.0), _run("pf-trl", 1.0)]
    report = {"runs": runs, "table": recompute_table(runs, ["d"])}
    check_table(report)
    assert report["table"][1]["ratio_to_padded"] == 2.0
    for key, value in (("ratio_to_padded", 2.5), ("real_tokens_per_second", 1.0), ("mfu", 0.9)):
        wrong = copy.deepcopy(report)
        wrong["table"][1][key] = value
        with pytest.raises(AssertionError):
            check_table(wrong)
    tampered = copy.deepcopy(report)  # a record changed after the table was made
    tampered["runs"][0]["steps"] = [dict(s, seconds=s["seconds"] * 10) for s in tampered["runs"][0]["steps"]]
    with pytest.raises(AssertionError):
        check_table(tampered)


# ------------------------------------------------------------------------------------------ flags


def _e2e_bench():
    spec = importlib.util.spec_from_file_location("e2e_bench", ROOT / "benchmarks" / "gpu" / "e2e_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, words", [
    (["--deadline-s", "0"], "no time to run any arm"),
    (["--deadline-s", "-5"], "no time to run any arm"),
    (["--arms", "trl-padded,warp-drive"], "unknown arm(s) ['warp-drive']"),
    (["--preset", "seed7b", "--arms", "pf-trl-hf"], "unknown arm(s) ['pf-trl-hf'] for --preset seed7b"),
    (["--preset", "seed7b", "--repeats", "2"], "--repeats: the seed experiment runs each arm once"),
    (["--preset", "seed7b", "--min-steps", "10", "--min-seconds", "5"], "--min-steps --min-seconds"),
    (["--preset", "seed7b", "--datasets", "alpaca_template"], "--datasets"),
    (["--repeat-arms", "nope"], "--repeat-arms: unknown arm(s)"),
    (["--min-steps", "0"], "--min-steps 0: must be positive"),
    (["--round-offset", "-1"], "--round-offset -1"),
])
def test_e2e_bench_refuses_in_one_line(argv, words, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        _e2e_bench().main(argv + ["--out", str(tmp_path), "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and words in err[-1], err


def test_e2e_bench_seed_honours_arms_and_deadline(capsys, tmp_path):
    """A deadline already past: every seed arm asked for is skipped with the reason, none trains; the JSON names
    the data. Negative control: a deadline with time runs the arm (the dry-run test)."""
    import json

    assert _e2e_bench().main(["--preset", "seed7b", "--arms", "trl-padded,pf-trl-same-batches", "--deadline-s",
                              "1e-9", "--out", str(tmp_path), "--dry-run"]) == 0
    report = json.loads((tmp_path / "e2e_seed7b.json").read_text())
    assert [(r["arm"], r["skipped"]) for r in report["runs"]] == [("trl-padded", "deadline reached"),
                                                                  ("pf-trl-same-batches", "deadline reached")]
    assert "NOT the Alpaca dataset" in report["data"]["what"] and "speedup_runtime" not in report
