"""``run_all.sh --dry-run`` through the stages of both device calls, on CPU (tiny models, float32), under the calls'
real ``DEADLINE_S`` (:data:`pf_trl.benchmarking.budget.CALLS`): the seed experiment like for like, every JSON
recomputable from its per-step records, the budget table from the dry runs, and the plan quoted alike by run_all.sh
and docs/gpu.md.

An opt-in test (marked ``extended``: ``PF_TRL_EXTENDED=1 bash scripts/test.sh``, or ``pytest -m extended`` on this
file), run before a device session as docs/gpu.md says: it runs every stage on CPU (~2.5 CPU-minutes) and its stages
keep the GPU calls' deadlines, which a CI machine shared with other suites does not reliably meet. The plan it runs
(each call's stages, commands, carry and timeouts, quoted alike by run_all.sh and docs/gpu.md) is checked in every
run by tests/test_gpu_runbook.py and by ``test_run_book_and_docs_quote_the_plan`` below."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pf_trl.benchmarking import budget as budget_module
from pf_trl.benchmarking.budget import CALLS, FILLER_STAGES, budget_table, format_budget
from pf_trl.benchmarking.e2e import merge_reports, recompute_table

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _dry_run(out: Path, stages: list[str], deadline_s: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "DEADLINE_S": str(deadline_s),
           "STAGES": " ".join(stages)}
    return subprocess.run(["bash", "benchmarks/gpu/run_all.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=deadline_s + 60)


# call 2's fillers that have their own scripts or arms (FA4, the best attention, attention check, long row); its
# ``alpaca`` and ``extras`` are the headline's bench with other rows and arms: ``run_all.sh --dry-run`` with every
# stage runs them, the budget in docs/gpu.md came from one
OWN_FILLERS = ("fa4", "best", "1", "5")


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """Each call's planned stages under its deadline; call 2 with its fillers of :data:`OWN_FILLERS` after them, as
    the call runs them (with the time left), in the same run (one run book start, not two)."""
    outs = []
    for i, call in enumerate(CALLS):
        out = tmp_path_factory.mktemp(f"call{i + 1}")
        stages = [s for s in call.stages if s not in FILLER_STAGES or (i == 1 and s in OWN_FILLERS)]
        proc = _dry_run(out, stages, call.deadline_s)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        for stage in call.stages:
            if stage not in FILLER_STAGES:
                assert f"== stage {stage} skipped" not in proc.stdout, proc.stdout[-3000:]
        outs.append(out)
    return outs


@pytest.mark.extended
def test_seed_experiment_like_for_like(planned):
    """The padding-free arm trains the padded arm's steps with its examples per step, batch for batch; the rows are
    named for what they are; the token-budget arm runs beside them over the same rows."""
    seed = json.loads((planned[0] / "e2e_seed7b.json").read_text())
    runs = {r["arm"]: r for r in seed["runs"]}
    assert list(runs) == ["trl-padded", "pf-trl-same-batches", "pf-trl"]
    padded, same = runs["trl-padded"], runs["pf-trl-same-batches"]
    assert same["optimizer_steps"] == padded["optimizer_steps"] == seed["optimizer_steps"]
    assert same["examples_per_step"] == padded["examples_per_step"] == [seed["examples_per_step"]] == [4]
    assert seed["same_batches"] is True and seed["same_tokens"] is True and seed["speedup_runtime"] > 0
    assert [s["real"] for s in same["steps"]] == [s["real"] for s in padded["steps"]]
    assert same["final_loss"] == pytest.approx(padded["final_loss"], rel=1e-4)  # the same batches, the same loss
    assert padded["summary"]["padding_share"] > 0 and same["summary"]["padding_share"] == 0
    # negative control: the token-budget arm packs other batches (other step count or examples per step)
    budget_arm = runs["pf-trl"]
    assert (budget_arm["optimizer_steps"], budget_arm["examples_per_step"]) != (3, [4])
    assert seed["same_tokens_token_budget"] is True and seed["speedup_token_budget"] > 0
    assert "ShareGPT first turns" in seed["data"]["what"] and "NOT the Alpaca dataset" in seed["data"]["what"]
    assert "What differs: the rows" in seed["comparison_with_seed"]


@pytest.mark.extended
def test_headline_rounds_merge_and_recompute(planned):
    """Round 1 (call 1) and round 2 (call 2, order rotated) of the headline merge into one table of two runs per
    arm, each table what its per-step records give (a tampered record gives another table)."""
    r1 = json.loads((planned[0] / "e2e_llama1b_sharegpt_multiturn.json").read_text())
    r2 = json.loads((planned[1] / "e2e_llama1b_sharegpt_multiturn_round2.json").read_text())
    assert [r["arm"] for r in r1["runs"]] == ["trl-padded", "pf-trl", "trl-pf-sdpa"]
    assert [r["arm"] for r in r2["runs"]] == ["pf-trl", "trl-pf-sdpa", "trl-padded"]
    merged = merge_reports([r1, r2])
    assert [(row["arm"], row["repeats"]) for row in merged["table"]] == [
        ("trl-padded", 2), ("pf-trl", 2), ("trl-pf-sdpa", 2)]
    for report in (r1, r2, merged):
        assert not [r for r in report["runs"] if "error" in r]
        assert recompute_table(report["runs"], ["sharegpt_multiturn"]) == report["table"]
        tampered = copy.deepcopy(report["runs"])
        tampered[0]["steps"][-1]["seconds"] *= 10
        assert recompute_table(tampered, ["sharegpt_multiturn"]) != report["table"]
        step = report["runs"][0]["steps"][-1]
        assert step["seconds"] >= step["data_seconds"] > 0  # the step's time holds its batch's fetch


@pytest.mark.extended
def test_budget_table_from_the_dry_runs(planned):
    budget = budget_table(planned)
    table = format_budget(budget)
    for call in budget["calls"]:
        assert [r["stage"] for r in call["stages"]] == list(CALLS[call["call"] - 1].stages)
        planned_stages = [r for r in call["stages"] if not r["filler"]]
        assert all(r["cpu_dry_run_host_s"] is not None and r["cpu_dry_run_host_s"] >= 0 and r["gpu_estimate_s"] > 0
                   for r in planned_stages)
    assert budget["window_margin_worst_case_s"] > 0 and budget["window_margin_expected_s"] > 0
    assert "margin" in table and f"DEADLINE_S {CALLS[0].deadline_s}" in table


@pytest.mark.extended
def test_budget_negative_control_a_plan_past_the_window(planned, monkeypatch):
    longer = tuple(budget_module.Call(c.stages, c.deadline_s + 200, c.timeout_s + 200, c.carry, c.kind)
                   for c in CALLS)
    monkeypatch.setattr(budget_module, "CALLS", longer)
    assert budget_module.budget_table(planned)["window_margin_worst_case_s"] < 0
    shorter = tuple(budget_module.Call(c.stages, 30, 60, c.carry, c.kind) for c in CALLS)
    monkeypatch.setattr(budget_module, "CALLS", shorter)
    assert all(c["margin_s"] < 0 for c in budget_module.budget_table(planned)["calls"])


def test_run_book_and_docs_quote_the_plan():
    """run_all.sh's header and docs/gpu.md give each call's command, carry and timeout as CALLS has them."""
    script = (ROOT / "benchmarks" / "gpu" / "run_all.sh").read_text()
    docs = (ROOT / "docs" / "gpu.md").read_text()
    for call in CALLS:
        for text in (script, docs):
            assert call.command() in text and f"timeout_s={call.timeout_s}" in text
            assert f"carry={json.dumps(list(call.carry))}" in text.replace("'", '"')
    assert "not yet measured" in docs


@pytest.mark.extended
def test_filler_stages_under_the_second_calls_deadline(planned):
    """Call 2's stages that run with the time left and have their own scripts or arms (:data:`OWN_FILLERS`), on CPU,
    after its planned stages under its DEADLINE_S: each ends, or is skipped by the deadline, and the call ends inside
    it; what ran wrote its JSON."""
    call, tmp_path = CALLS[1], planned[1]
    rows = dict(line.split("\t") for line in (tmp_path / "stage_seconds.tsv").read_text().splitlines())
    assert [s for s in rows if s != "setup"] == [s for s in call.stages if s not in FILLER_STAGES or s in OWN_FILLERS]
    ran = [s for s in FILLER_STAGES if rows.get(s) not in (None, "skipped")]
    planned_stages = [s for s in call.stages if s not in FILLER_STAGES]
    assert ran and sum(float(rows[s]) for s in ["setup", *planned_stages, *ran]) <= call.deadline_s + 10
    for stage, name in (("5", "long_row.json"), ("1", "attention_check.json"),
                        ("alpaca", "e2e_llama1b_alpaca_template.json"),
                        ("best", "e2e_llama1b_sharegpt_multiturn_best.json")):
        if stage in ran:
            assert (tmp_path / name).is_file(), name
    if "best" in ran:
        best = json.loads((tmp_path / "e2e_llama1b_sharegpt_multiturn_best.json").read_text())
        assert [r["arm"] for r in best["runs"]] == ["trl-pf-best", "pf-trl-hf"]
        assert not any("error" in r for r in best["runs"])
    if "5" in ran:
        long_row = json.loads((tmp_path / "long_row.json").read_text())
        assert long_row["segments_per_step"] == [len(long_row["segments"])] * (1 + long_row["timed_steps"])
        assert len(long_row["step_mfu"]) == 4
