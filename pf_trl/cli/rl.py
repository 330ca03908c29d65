"""`pf-trl grpo` and `pf-trl rloo`: GRPO / RLOO, padding-free. The flags of ``trl grpo`` / ``trl rloo`` (TRL's
script arguments with ``--reward_funcs`` and ``--reward_model_name_or_path``, ``GRPOConfig`` / ``RLOOConfig``,
``ModelConfig``, ``DatasetMixtureConfig``) plus pf-trl's ``--shared_prefix`` and ``--attention_backend``, and
``--config FILE.yaml`` as TRL reads it:

    pf-trl grpo --model_name_or_path pf-trl/tiny-llama --dataset_name prompts/ --reward_funcs my_rewards.score \
        --output_dir out --num_generations 4 --max_completion_length 64 --beta 0.04

Bad input is refused in one line (exit status 2). :func:`pf_trl.trainer.rl.script.run_rl` does the work.
"""

from __future__ import annotations

import sys

from pf_trl.errors import ConfigError, PfTrlError


class _OneLineParserError(ConfigError):
    """A flag the parser refused (printed as one line, not argparse's usage block)."""


def _parser(kind: str):
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    if kind == "grpo":
        from trl.scripts.grpo import GRPOScriptArguments as script_cls

        from pf_trl.trainer.rl.grpo import PaddingFreeGRPOConfig as config_cls
    else:
        from trl.scripts.rloo import RLOOScriptArguments as script_cls

        from pf_trl.trainer.rl.rloo import PaddingFreeRLOOConfig as config_cls
    parser = TrlParser((script_cls, config_cls, ModelConfig, DatasetMixtureConfig), prog=f"pf-trl {kind}")

    def error(message):  # argparse prints the whole usage first: one line instead
        raise _OneLineParserError(message)

    parser.error = error
    return parser


def main(kind: str, argv: list[str] | None = None) -> int:
    """Run ``pf-trl grpo`` (``kind="grpo"``) or ``pf-trl rloo`` with ``argv``; the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = _parser(kind)
        if any(a in ("-h", "--help") for a in argv):
            parser.print_help()
            return 0
        *parsed, rest = parser.parse_args_and_config(args=argv, return_remaining_strings=True)
        if rest:
            raise _OneLineParserError(f"unrecognized arguments: {' '.join(rest)}")
    except (_OneLineParserError, PfTrlError, ValueError, OSError) as exc:  # flags, values, the --config file
        print(f"pf-trl {kind}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    from pf_trl.trainer.rl.script import run_rl

    try:
        run_rl(kind, *parsed)
    except PfTrlError as exc:
        print(f"pf-trl {kind}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0
