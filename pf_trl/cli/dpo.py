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

from pf_trl.errors import ConfigError, PfTrlError


class _OneLineParserError(ConfigError):
    """A flag the parser refused (printed as one line, not argparse's usage block)."""


def _parser():
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

    from pf_trl.trainer.dpo_config import PaddingFreeDPOConfig

    parser = TrlParser((ScriptArguments, PaddingFreeDPOConfig, ModelConfig, DatasetMixtureConfig), prog="pf-trl dpo")

    def error(message):  # argparse prints the whole usage first: one line instead
        raise _OneLineParserError(message)

    parser.error = error
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = _parser()
        if any(a in ("-h", "--help") for a in argv):
            parser.print_help()
            return 0
        *parsed, rest = parser.parse_args_and_config(args=argv, return_remaining_strings=True)
        if rest:
            raise _OneLineParserError(f"unrecognized arguments: {' '.join(rest)}")
    except (_OneLineParserError, PfTrlError, ValueError, OSError) as exc:  # flags, values, the --config file
        print(f"pf-trl dpo: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    from pf_trl.trainer.dpo_script import run_dpo

    try:
        run_dpo(*parsed)
    except PfTrlError as exc:
        print(f"pf-trl dpo: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
