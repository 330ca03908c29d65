"""PaddingFreeDPOTrainer on two CPU ranks (torchrun, gloo) against one process with the same pairs per optimizer step.

One ``torchrun --nproc_per_node 2`` launch (tests/dpo_dist_harness.py) trains, in turn:

- ``fixed``: 2 pairs per rank and step (TRL's sampler, sharded by accelerate) for 2 steps: the logged loss, gradient
  norm and every TRL metric equal one process with 4 pairs per step, pf-trl's and TRL's own DPOTrainer, and so do the
  weights; control: the metrics of one rank's pairs alone differ (the ranks' metrics are gathered);
- ``budget``: token-budget micro-batches (whole pairs, rank-balanced; the two ranks hold different numbers of pairs):
  the reduced gradient of the step, its logged loss and TRL's metrics (per-pair values gathered from ranks of uneven
  pair counts) equal TRL's for one batch holding all the step's pairs; control: each rank's plain mean
  (``budget_unweighted``) gives another gradient and loss.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from test_distributed import _env, _failure, _torchrun  # the project's torchrun harness (gloo on loopback)

from tests import dpo_support as S

from tolerances import assert_bit_equal

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

HARNESS = __file__.replace("test_dpo_distributed.py", "dpo_dist_harness.py")
FIXED_ROWS = [8, 5]  # S.pairs(8, seed=5): 2 steps of 4 pairs
BUDGET_ROWS = [10, 3]
BUDGET = 150  # the first micro-batches of the two ranks hold 2 and 3 pairs (asserted below)
FIXED = dict(max_steps=2, per_device_train_batch_size=2)
BUDGET_KW = dict(max_steps=1, per_device_train_batch_size=1, max_tokens_per_batch=BUDGET, learning_rate=0.0,
                 max_grad_norm=1e9)


def _two_ranks(out) -> dict[str, list[dict]]:
    jobs = [dict(name="fixed", trainer="pf", rows=FIXED_ROWS, kw=FIXED),
            dict(name="budget", trainer="pf", rows=BUDGET_ROWS, kw=BUDGET_KW),
            dict(name="budget_unweighted", trainer="pf", rows=BUDGET_ROWS, kw=BUDGET_KW, unweighted=True)]
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "jobs": jobs}))
    proc = subprocess.run(_torchrun(HARNESS, str(spec)), env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, _failure(proc)
    return {job["name"]: [torch.load(out / job["name"] / f"result_{r}.pt") for r in (0, 1)] for job in jobs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from trl import DPOTrainer

    out = tmp_path_factory.mktemp("dpo_two_ranks")
    two = _two_ranks(out)
    one = {name: S.run_job(dict(name=name, trainer=trainer, rows=FIXED_ROWS, kw=dict(FIXED, **kw)), str(out))
           for name, trainer, kw in (("trl_fixed", "trl", dict(per_device_train_batch_size=4)),
                                     ("pf_fixed", "pf", dict(per_device_train_batch_size=4)),
                                     ("pf_one_rank_pairs", "pf", {}))}
    # TRL, one batch holding every pair of the two ranks' first step
    step = sorted(two["budget"][0]["batches"][0] + two["budget"][1]["batches"][0])
    rows = S.pairs(BUDGET_ROWS[0], seed=BUDGET_ROWS[1])
    kw = {k: v for k, v in BUDGET_KW.items() if k != "max_tokens_per_batch"}
    trl = S.trainer(S.recording(DPOTrainer), [rows[i] for i in step], out / "trl_whole",
                    **dict(kw, per_device_train_batch_size=len(step)))
    trl.train()
    one["trl_whole"] = {"grad": trl.pf_grad, "history": S.logged(trl.state.log_history)}
    return two, one


def test_two_ranks_with_fixed_pairs_equal_one_process_and_trl(runs):
    two, one = runs
    r0, r1 = two["fixed"]
    assert r0["world"] == r1["world"] == 2
    # the same pairs per optimizer step: each rank half of them, none on both
    for step in range(2):
        mine0, mine1 = ({tuple(s) for s in r["seen"][step]} for r in (r0, r1))
        assert len(mine0) == len(mine1) == 2 and not mine0 & mine1
        assert mine0 | mine1 == {tuple(s) for s in one["pf_fixed"]["seen"][step]}
    assert_bit_equal(r0["history"], r1["history"], why="every rank logs the same gathered values (the all-reduce "
                     "hands each rank the same bits; the gradient norm is taken of the same reduced gradients)")
    assert S.compare_logs(one["trl_fixed"]["history"], r0["history"]) == []
    assert S.compare_logs(one["pf_fixed"]["history"], r0["history"]) == []
    for name, value in one["pf_fixed"]["weights"].items():
        torch.testing.assert_close(r0["weights"][name], value, rtol=1e-4, atol=2e-6, msg=name)
    # control: one rank's own pairs (what a rank would log without gathering) give other metrics
    assert S.compare_logs(one["pf_one_rank_pairs"]["history"], r0["history"])


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) / float(a[n].abs().max()) for n in a)


def test_two_ranks_token_budget_step_is_the_mean_over_all_its_pairs(runs):
    two, one = runs
    r0, r1 = two["budget"]
    first0, first1 = r0["batches"][0], r1["batches"][0]
    assert not set(first0) & set(first1) and len(first0) != len(first1)  # uneven pairs: the weighting matters
    assert [len(s) for s in r0["seen"]] == [len(first0)] and [len(s) for s in r1["seen"]] == [len(first1)]
    assert _worst(r0["grad"], r1["grad"]) < 1e-6  # reduced over the ranks
    assert _worst(one["trl_whole"]["grad"], r0["grad"]) < S.GRAD_RTOL
    # the logged loss and every metric too: the per-pair metrics gathered from ranks of uneven pair counts
    assert S.compare_logs(one["trl_whole"]["history"], r0["history"]) == []
    # control: each rank's plain mean, averaged over the ranks, is not the mean over the step's pairs
    unweighted = two["budget_unweighted"][0]
    assert _worst(one["trl_whole"]["grad"], unweighted["grad"]) > 1e-3
    assert [b.split(":")[0] for b in S.compare_logs(one["trl_whole"]["history"], unweighted["history"])] == [
        "step 0 loss", "step 0 grad_norm"]
