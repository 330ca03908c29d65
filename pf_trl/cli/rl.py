"""`pf-trl grpo` and `pf-trl rloo`: GRPO / RLOO, padding-free. The flags of ``trl grpo`` / ``trl rloo`` (TRL's
script arguments with ``--reward_funcs`` and ``--reward_model_name_or_path``, ``GRPOConfig`` / ``RLOOConfig``,
``ModelConfig``, ``DatasetMixtureConfig``) plus pf-trl's ``--shared_prefix``, ``--attention_backend`` and
``--max_tokens_per_forward``, and ``--config FILE.yaml`` as TRL reads it:

    pf-trl grpo --model_name_or_path pf-trl/tiny-llama --dataset_name prompts/ --reward_funcs my_rewards.score \
        --output_dir out --num_generations 4 --max_completion_length 64 --beta 0.04

Bad input is refused in one line (exit status 2). :func:`pf_trl.trainer.rl.script.run_rl` does the work.
"""

from __future__ import annotations

import functools

from pf_trl.cli.trl_script_cli import run_trl_script


def _classes(kind: str) -> tuple[type, type]:
    """TRL's script arguments of ``trl grpo`` / ``trl rloo`` and pf-trl's config for ``kind``."""
    if kind == "grpo":
        from trl.scripts.grpo import GRPOScriptArguments as script_cls

        from pf_trl.trainer.rl.grpo import PaddingFreeGRPOConfig as config_cls
    else:
        from trl.scripts.rloo import RLOOScriptArguments as script_cls

        from pf_trl.trainer.rl.rloo import PaddingFreeRLOOConfig as config_cls
    return script_cls, config_cls


def _run(kind: str):
    from pf_trl.trainer.rl.script import run_rl

    return functools.partial(run_rl, kind)


def main(kind: str, argv: list[str] | None = None) -> int:
    """Run ``pf-trl grpo`` (``kind="grpo"``) or ``pf-trl rloo`` with ``argv``; the exit status."""
    return run_trl_script(argv, f"pf-trl {kind}", lambda: _classes(kind)[1], lambda: _run(kind),
                          script_cls=lambda: _classes(kind)[0])
