"""`pf-trl dpo`: preference training, padding-free. The flags of ``trl dpo`` (TRL's ``ScriptArguments``,
``DPOConfig``, ``ModelConfig``, ``DatasetMixtureConfig``) plus pf-trl's (:class:`~pf_trl.trainer.dpo_config.
PaddingFreeDPOConfig`: ``--max_tokens_per_batch``, ``--padding_free_mode``, ...), and ``--config FILE.yaml`` as TRL
reads it (its keys as flags; the command line wins):

    pf-trl dpo --model_name_or_path pf-trl/tiny-llama --dataset_name pairs.jsonl --output_dir out \
        --per_device_train_batch_size 4 --beta 0.1 --max_steps 100

Bad input is refused in one line (exit status 2). :func:`pf_trl.trainer.dpo_script.run_dpo` does the work.
"""

from __future__ import annotations

import sys

from pf_trl.cli.trl_script_cli import run_trl_script


def _config_cls():
    from pf_trl.trainer.dpo_config import PaddingFreeDPOConfig

    return PaddingFreeDPOConfig


def _run():
    from pf_trl.trainer.dpo_script import run_dpo

    return run_dpo


def main(argv: list[str] | None = None) -> int:
    return run_trl_script(argv, "pf-trl dpo", _config_cls, _run)


if __name__ == "__main__":
    sys.exit(main())
