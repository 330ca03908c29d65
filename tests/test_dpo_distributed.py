"""PaddingFreeDPOTrainer on two CPU ranks (torchrun, gloo) against one process with the same pairs per optimizer step.

One ``torchrun --nproc_per_node 2`` launch (tests/dpo_dist_harness.py) trains, in turn:

- ``fixed``: 2 pairs per rank and step (TRL's sampler, sharded by accelerate) for 2 steps: the logged loss, gradient
  norm and every TRL metric equal one process with 4 pairs per step, pf-trl's and TRL's own DPOTrainer, and so do the
  weights; control: the metrics of one rank's pairs alone differ (the ranks' metrics are gathered);
- ``budget``: token-budget micro-batches (whole pairs, rank-balanced; the two ranks hold different numbers of pairs):
  the reduced gradient of the step, its logged loss and TRL's metrics (per-pair values gathered from ranks of uneven
  pair counts) equal TRL's for one batch holding all the step's pairs; control: each rank's plain mean
  (``budget_unweighted``) gives another gradient and loss;

and, in the same launch (tests/rl_kto_dist_jobs.py: their imports added, not a second launch's):

- GRPO's ``max_tokens_per_forward``, one step, for ``grpo`` (a per-sequence mean of each rank's micro-batch),
  ``dapo`` (a sum over tokens divided by ``num_items_in_batch``, the completion tokens of every rank), ``bnpo`` (a
  token mean of each rank's micro-batch) and RLOO's loss
  (a per-sequence mean, which the Trainer scales for accumulation): without a budget
  and with one that splits every micro-batch of both ranks into several packed forwards (the ranks holding different
  numbers of completion tokens). The split step's loss, every logged metric and the gradient after DDP's reduction
  equal the unsplit step's, within ``sum_rtol`` of the step's tokens (the forwards' per-token values round
  differently and everything is a sum over them); control: ``dapo``'s pieces normalised by their rank's own completion
  tokens instead of by ``num_items_in_batch`` give another gradient;
- KTO, two steps, TRL's KTOTrainer and PaddingFreeKTOTrainer on the same rows: the loss, the gradient norm, every KTO
  metric (tests/test_kto_trainer.py's tolerance) and the first step's reduced gradient equal, with a reference model
  and with its log-probabilities precomputed (each rank's share, packed); the KL term is the mean of both ranks'
  estimates (TRL gathers it); control: each rank's own estimate differs from it;
- the reward model, two steps, TRL's RewardTrainer and PaddingFreeRewardTrainer on the same pairs (the ranks'
  micro-batches of different lengths; margins, ``center_rewards_coefficient``): the loss, every logged metric and the
  first step's reduced gradient equal within ``sum_rtol`` of the step's real tokens; the logged accuracy and margin
  are the mean of both ranks' own values and the min / mean / max reward those of both ranks' rewards (TRL gathers
  them); control: one rank's own margin differs from the gathered one.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from test_distributed import _env, _failure, _torchrun  # the project's torchrun harness (gloo on loopback)

from tests import dpo_support as S
from tests import rl_support as R
from tests.test_kto_trainer import ROWS as KTO_ROWS
from tests.test_kto_trainer import RTOL as KTO_RTOL
from tests.test_kto_trainer import assert_same_metrics
from tests.tolerances import assert_other_math, assert_same_math, sum_rtol

from tolerances import assert_bit_equal

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

HARNESS = __file__.replace("test_dpo_distributed.py", "dpo_dist_harness.py")
FIXED_ROWS = [8, 5]  # S.pairs(8, seed=5): 2 steps of 4 pairs
BUDGET_ROWS = [10, 3]
BUDGET = 150  # the first micro-batches of the two ranks hold 2 and 3 pairs (asserted below)
FIXED = dict(max_steps=2, per_device_train_batch_size=2)
BUDGET_KW = dict(max_steps=1, per_device_train_batch_size=1, max_tokens_per_batch=BUDGET, learning_rate=0.0,
                 max_grad_norm=1e9)


# GRPO: a budget under every micro-batch of 2 groups (each rank's 4 sequences) that still holds several sequences:
# forwards of uneven sizes, a group's prompt held once in each
RL_BUDGET = 24
# one loss type of each normalisation a piece keeps (rl/budget.py): per sequence, per generation batch, per token of
# the micro-batch; rloo: PaddingFreeRLOOTrainer (its loss left to the Trainer to scale)
RL_LOSS_TYPES = ("grpo", "dapo", "bnpo", "rloo")
RL_JOBS = [*(dict(name=f"{loss}_{how}", kind="rl", loss_type=loss, budget=budget, control=None)
             for loss in RL_LOSS_TYPES for how, budget in (("whole", None), ("split", RL_BUDGET))),
           dict(name="dapo_local", kind="rl", loss_type="dapo", budget=RL_BUDGET, control="local"),
           *(dict(name=f"kto_{trainer}{suffix}", kind="kto", trainer=trainer, precompute=bool(suffix))
             for trainer in ("trl", "pf") for suffix in ("", "_pre")),
           dict(name="precompute_refusal", kind="precompute_refusal")]
REWARD_JOBS = [dict(name=f"reward_{trainer}", kind="reward", trainer=trainer) for trainer in ("trl", "pf")]


def _two_ranks(out) -> dict[str, list[dict]]:
    jobs = [dict(name="fixed", trainer="pf", rows=FIXED_ROWS, kw=FIXED),
            dict(name="budget", trainer="pf", rows=BUDGET_ROWS, kw=BUDGET_KW),
            dict(name="budget_unweighted", trainer="pf", rows=BUDGET_ROWS, kw=BUDGET_KW, unweighted=True), *RL_JOBS,
            *REWARD_JOBS]
    spec = out / "spec.json"
    kto_rows = out / "kto_rows.jsonl"  # one file, written before the launch: the same dataset cache for both ranks
    kto_rows.write_text("".join(json.dumps(r) + "\n" for r in KTO_ROWS))
    spec.write_text(json.dumps({"out": str(out), "folder": R.model_folder(out), "jobs": jobs,
                                "kto_rows": str(kto_rows)}))
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


# ------------------------------------------------------------------------------------- GRPO budget, KTO (same launch)


def _numbers(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if isinstance(v, (int, float))} for h in history]


def _rl_rtol(ranks: list[dict]) -> float:
    """``sum_rtol`` of the step's tokens: the completions' and the prompts' (at most 16 a prompt, 4 per rank)."""
    return sum_rtol(sum(int(s["completion_mask"].sum()) for r in ranks for s in r["seen"]) + 2 * 4 * 16)


@pytest.mark.parametrize("loss_type", RL_LOSS_TYPES)
def test_two_ranks_grpo_budget_keeps_the_unsplit_step(runs, loss_type):
    two, _ = runs
    whole, split = two[f"{loss_type}_whole"], two[f"{loss_type}_split"]
    assert [r["world"] for r in whole + split] == [2] * 4
    for w, s in zip(whole, split):
        # the same completions (generation comes before the loss), every micro-batch split into several forwards
        assert len(w["seen"]) == len(s["seen"]) == 1
        assert torch.equal(w["seen"][0]["completion_ids"], s["seen"][0]["completion_ids"])
        assert w["plans"] == [] and len(s["plans"]) == 1 and s["plans"][0] >= 2
    tokens = [int(r["seen"][0]["completion_mask"].sum()) for r in split]
    assert tokens[0] != tokens[1]  # the ranks' local token counts differ from their mean (dapo's normaliser)
    if loss_type != "rloo":
        assert [r["seen"][0]["num_items_in_batch"] for r in split] == [float(sum(tokens))] * 2
    rtol = _rl_rtol(split)
    assert_same_math(split[0]["grad"], split[1]["grad"], what="the reduced gradient on the two ranks")
    assert_same_math(_numbers(split[0]["history"]), _numbers(whole[0]["history"]), what=f"{loss_type} logs",
                     rtol=rtol)
    assert_same_math(split[0]["grad"], whole[0]["grad"], what=f"{loss_type} gradient", rtol=rtol)
    first = whole[0]["history"][0]
    assert {"loss", "grad_norm", "kl", "entropy", "clip_ratio/region_mean"} <= set(first)
    assert first["kl"] > 1e-4 and first["grad_norm"] > 1e-3
    # not a zero loss that any weighting keeps (RLOO's first-step loss is -mean(advantages), zero; its gradient is not)
    assert loss_type == "rloo" or abs(first["loss"]) > 1e-4


def test_two_ranks_grpo_budget_control_local_normaliser_differs(runs):
    two, _ = runs
    whole, local = two["dapo_whole"], two["dapo_local"]
    assert local[0]["plans"][0] >= 2
    rtol = _rl_rtol(local)
    assert_other_math(local[0]["grad"], whole[0]["grad"], what="dapo pieces under the local normaliser", rtol=rtol)
    assert_other_math(local[0]["history"][0]["grad_norm"], whole[0]["history"][0]["grad_norm"],
                      what="dapo gradient norm under the local normaliser", rtol=rtol)


@pytest.mark.parametrize("precompute", [False, True], ids=["reference", "precomputed"])
def test_two_ranks_kto_equals_trl(runs, precompute):
    two, _ = runs
    suffix = "_pre" if precompute else ""
    trl, pf = two[f"kto_trl{suffix}"], two[f"kto_pf{suffix}"]
    assert [r["world"] for r in trl + pf] == [2] * 4
    expected, got = trl[0]["history"], pf[0]["history"]
    keys = {k for h in expected for k in h}
    assert {"loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen"} <= keys
    assert len(expected) == len(got) and sum("kl" in h for h in got) == 2
    for step, (mine, theirs) in enumerate(zip(expected, got, strict=True)):
        assert_same_metrics(mine, {k: v for k, v in theirs.items() if k in keys}, f"log {step}")
    assert_same_math(pf[0]["grad"], trl[0]["grad"], what="first step's reduced gradient", rtol=S.GRAD_RTOL)
    if precompute:  # the reference's KL scores precomputed per rank, gathered by TRL with the dataset's
        return
    # the KL term is both ranks' (TRL gathers it): the mean of their own estimates, which differ from it
    for step, logged in enumerate(h["kl"] for h in got if "kl" in h):
        own = [r["local_kl"][step] for r in pf]
        assert logged > 0.5
        assert_same_math(logged, sum(own) / 2, what=f"step {step} kl", rtol=KTO_RTOL)
        for value in own:
            assert_other_math(value, logged, what=f"step {step}: one rank's own kl", rtol=KTO_RTOL)


def test_two_ranks_refuse_a_precompute_into_an_in_memory_dataset_in_one_line(runs):
    """TRL's reference precompute writes into the dataset's cache folder on rank 0 and every rank reads it: an in-memory
    dataset's folder is each process's own (TRL fails with FileNotFoundError on rank 1). The same trainers with the
    rows loaded from a JSONL train (``kto_pf_pre``, above): the control."""
    two, _ = runs
    for rank in two["precompute_refusal"]:
        assert rank["world"] == 2 and set(rank["refused"]) == {"kto", "dpo"}
        for message in rank["refused"].values():
            assert message.startswith("precompute_ref_log_probs=True on 2 processes") and "\n" not in message
            assert "load_dataset or load_from_disk" in message
    assert two["kto_pf_pre"][0]["history"]


# ------------------------------------------------------------------------------------- reward model (same launch)


def test_two_ranks_reward_model_equals_trl(runs):
    two, _ = runs
    trl, pf = two["reward_trl"], two["reward_pf"]
    assert [r["world"] for r in trl + pf] == [2] * 4
    for step in range(2):  # the ranks' micro-batches hold pairs of different lengths
        assert pf[0]["local"][step]["tokens"] != pf[1]["local"][step]["tokens"]
    # each reward is a linear map of a hidden state that attention summed over its sequence: the step's real tokens
    rtol = sum_rtol(sum(r["local"][0]["tokens"] for r in pf))
    expected, got = _numbers(trl[0]["history"]), _numbers(pf[0]["history"])
    keys = {k for h in expected for k in h}
    assert {"loss", "grad_norm", "num_tokens", "accuracy", "margin", "min_reward", "mean_reward", "max_reward"} <= keys
    assert len(expected) == len(got) == 3 and all(h.keys() <= g.keys() for h, g in zip(expected, got))
    assert_same_math(expected, [{k: v for k, v in g.items() if k in h} for h, g in zip(expected, got)],
                     what="reward logs", rtol=rtol)
    assert_same_math(pf[0]["grad"], pf[1]["grad"], what="the reduced gradient on the two ranks")
    assert_same_math(pf[0]["grad"], trl[0]["grad"], what="first step's reduced gradient", rtol=rtol)
    for step, logged in enumerate(got[:2]):  # both ranks' values, gathered (pf-trl's as TRL's)
        own = [r["local"][step] for r in pf]
        rewards = torch.tensor(own[0]["rewards"] + own[1]["rewards"])
        assert logged["accuracy"] == sum(o["accuracy"] for o in own) / 2
        assert_same_math([logged["margin"], logged["min_reward"], logged["mean_reward"], logged["max_reward"]],
                         [sum(o["margin"] for o in own) / 2, *map(float, (rewards.min(), rewards.mean(),
                                                                         rewards.max()))],
                         what=f"step {step} gathered metrics", rtol=rtol)
        # control: a rank's own margin (what it logs without the gather) is not the step's
        for value in own:
            assert_other_math(value["margin"], logged["margin"], what=f"step {step}: one rank's own margin", rtol=rtol)
