"""`pf-trl reward`: reward-model training, padding-free. The flags of ``trl reward`` (TRL's ``ScriptArguments``,
``RewardConfig``, ``ModelConfig``, ``DatasetMixtureConfig``) plus pf-trl's (:class:`~pf_trl.trainer.preference.
reward_config.PaddingFreeRewardConfig`: ``--max_tokens_per_batch``, ``--padding_free_mode``, ...), and ``--config
FILE.yaml`` as TRL reads it:

    pf-trl reward --model_name_or_path ./my-model --dataset_name pairs.jsonl --output_dir out \
        --per_device_train_batch_size 8 --max_steps 100

Bad input is refused in one line (exit status 2). :func:`pf_trl.trainer.preference.reward_script.run_reward` does
the work.
"""

from __future__ import annotations

import sys

from pf_trl.cli.trl_script_cli import run_trl_script


def _config_cls():
    from pf_trl.trainer.preference.reward_config import PaddingFreeRewardConfig

    return PaddingFreeRewardConfig


def _run():
    from pf_trl.trainer.preference.reward_script import run_reward

    return run_reward


def main(argv: list[str] | None = None) -> int:
    return run_trl_script(argv, "pf-trl reward", _config_cls, _run)


if __name__ == "__main__":
    sys.exit(main())
