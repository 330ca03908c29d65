"""`pf-trl kto`: KTO training (unpaired desirable / undesirable completions), padding-free. The flags of ``trl kto``
(TRL's ``ScriptArguments``, ``KTOConfig``, ``ModelConfig``, ``DatasetMixtureConfig``) plus pf-trl's
(:class:`~pf_trl.trainer.preference.kto_config.PaddingFreeKTOConfig`: ``--padding_free_mode``, ...), and
``--config FILE.yaml`` as TRL reads it:

    pf-trl kto --model_name_or_path ./my-model --dataset_name rows.jsonl --output_dir out \
        --per_device_train_batch_size 8 --max_steps 100

Bad input is refused in one line (exit status 2). :func:`pf_trl.trainer.preference.kto_script.run_kto` does the
work.
"""

from __future__ import annotations

import sys

from pf_trl.cli.trl_script_cli import run_trl_script


def _config_cls():
    from pf_trl.trainer.preference.kto_config import PaddingFreeKTOConfig

    return PaddingFreeKTOConfig


def _run():
    from pf_trl.trainer.preference.kto_script import run_kto

    return run_kto


def main(argv: list[str] | None = None) -> int:
    return run_trl_script(argv, "pf-trl kto", _config_cls, _run)


if __name__ == "__main__":
    sys.exit(main())
