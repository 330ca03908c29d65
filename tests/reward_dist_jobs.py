"""Two-rank reward-model trainings that tests/dpo_dist_harness.py runs beside the DPO, GRPO and KTO ones in its
torchrun launch (``torchrun --nproc_per_node 2``, gloo, CPU), for tests/test_dpo_distributed.py.

A ``JOB`` (:func:`run_job`) is ``{"name", "kind": "reward", "trainer"}``: ``trainer`` ``"trl"`` (TRL's
RewardTrainer) or ``"pf"`` (PaddingFreeRewardTrainer) trains two steps of 2 pairs per rank (:data:`ROWS`: margins,
``center_rewards_coefficient``) on tests/test_reward_trainer.py's tiny sequence-classification model. Returns the
logged history, the gradient of the first optimizer step after the ranks' reduction, and each rank's own values of
each step before TRL gathers them (``local``: accuracy, margin, the rewards, the real tokens of its micro-batch).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests import dpo_support as S

# 2 steps of 2 pairs per rank; the margins make TRL's loss read the ``margin`` column
ROWS = [dict(r, margin=0.1 * i) for i, r in enumerate(S.pairs(8, seed=5))]
CONFIG = dict(per_device_train_batch_size=2, max_steps=2, center_rewards_coefficient=0.05)


def reward_job(job: dict, out: Path) -> dict:
    from trl import RewardTrainer

    from pf_trl.trainer.preference import PaddingFreeRewardTrainer
    from tests.rl_kto_dist_jobs import _FirstGradient
    from tests.test_reward_trainer import build

    t = build(PaddingFreeRewardTrainer if job["trainer"] == "pf" else RewardTrainer, ROWS, out, **CONFIG)
    grads: dict = {}
    t.add_callback(_FirstGradient(t.model, grads))
    local = []
    compute = t.compute_loss

    def recorded(model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = compute(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if t.model.training:
            chosen, rejected = torch.chunk(outputs.logits.detach().squeeze(-1), chunks=2)
            local.append({"accuracy": float((chosen > rejected).float().mean()),
                          "margin": float((chosen - rejected).mean()),
                          "rewards": outputs.logits.detach().flatten().tolist(),
                          "tokens": int(inputs["attention_mask"].sum())})
        return (loss, outputs) if return_outputs else loss

    t.compute_loss = recorded
    t.train()
    return {"history": [{k: v for k, v in h.items() if not k.endswith(("runtime", "per_second", "tflops"))
                         and not k.startswith("train_")} for h in t.state.log_history],
            "grad": grads, "local": local, "world": t.args.world_size}


def run_job(job: dict, spec: dict) -> dict:
    """``job`` (see the module docstring) in this process; ``spec``'s ``out`` holds its folder."""
    import torch.distributed as dist

    result = reward_job(job, Path(spec["out"]) / job["name"])
    return dict(result, name=job["name"], rank=dist.get_rank() if dist.is_initialized() else 0)
