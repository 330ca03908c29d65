"""Two-rank DPO trainings for tests/test_dpo_distributed.py, under ``torchrun --nproc_per_node 2`` (gloo, CPU).

    torchrun --standalone --nproc_per_node 2 tests/dpo_dist_harness.py SPEC.json

``SPEC``: ``{"out": DIR, "folder": TINY_MODEL_FOLDER, "jobs": [JOB, ...]}``, each ``JOB`` as
:func:`tests.dpo_support.run_job` takes it (DPO), or with a ``kind`` as :func:`tests.rl_kto_dist_jobs.run_job` takes
it (GRPO / RLOO from the model in ``folder``, KTO), or ``kind="reward"`` as :func:`tests.reward_dist_jobs.run_job`
takes it. The jobs run one after the other in the same two processes (one
launch: the imports are paid once). Each writes ``OUT/NAME/result_RANK.pt`` (DPO: the logged history, the pairs of
every micro-batch, the budget sampler's batches, the first step's gradient after the ranks' reduction, the final
weights).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: `tests` and `pf_trl`

import torch

from tests import dpo_support as S


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    for job in spec["jobs"]:
        if job.get("kind", "dpo") == "dpo":
            result = S.run_job(job, spec["out"])
        elif job["kind"] == "reward":  # TRL's RewardTrainer or PaddingFreeRewardTrainer, in the same launch
            from tests import reward_dist_jobs

            result = reward_dist_jobs.run_job(job, spec)
        else:  # GRPO / KTO jobs, run in the same launch (their imports added, not a second launch's)
            from tests import rl_kto_dist_jobs

            result = rl_kto_dist_jobs.run_job(job, spec)
        folder = Path(spec["out"]) / job["name"]
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(result, folder / f"result_{result['rank']}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    # every result is on disk: leave without gloo's C++ teardown, whose threads abort the process now and then on a
    # loaded machine (tests/test_distributed.py says the same)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
