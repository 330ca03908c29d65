"""The command line of pf-trl's TRL-script commands (``pf-trl dpo``, ``reward``, ``kto``, ``grpo``, ``rloo``): TRL's
parser over its script's dataclasses (its script arguments, the trainer's config, ``ModelConfig``,
``DatasetMixtureConfig``) with pf-trl's config in place of TRL's, ``--config FILE.yaml`` as TRL reads it, every refusal
one line (exit status 2)."""

from __future__ import annotations

import sys
from collections.abc import Callable

from pf_trl.errors import ConfigError, PfTrlError

__all__ = ["run_trl_script"]


class _OneLineParserError(ConfigError):
    """A flag the parser refused (printed as one line, not argparse's usage block)."""


def _parser(config_cls: type, prog: str, script_cls: type | None = None):
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

    parser = TrlParser((script_cls or ScriptArguments, config_cls, ModelConfig, DatasetMixtureConfig), prog=prog)

    def error(message):  # argparse prints the whole usage first: one line instead
        raise _OneLineParserError(message)

    parser.error = error
    return parser


def run_trl_script(argv: list[str] | None, prog: str, config_cls: Callable[[], type],
                   run: Callable[[], Callable[..., object]], script_cls: Callable[[], type] | None = None) -> int:
    """Parse ``argv`` for ``prog`` (``config_cls()``: the config class, ``script_cls()``: the script arguments when
    not TRL's plain ``ScriptArguments``, both imported late) and call ``run()(*parsed)``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = _parser(config_cls(), prog, script_cls() if script_cls is not None else None)
        if any(a in ("-h", "--help") for a in argv):
            parser.print_help()
            return 0
        *parsed, rest = parser.parse_args_and_config(args=argv, return_remaining_strings=True)
        if rest:
            raise _OneLineParserError(f"unrecognized arguments: {' '.join(rest)}")
    except (_OneLineParserError, PfTrlError, ValueError, OSError) as exc:  # flags, values, the --config file
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    try:
        from pf_trl.cli.upstream import check_push_to_hub

        check_push_to_hub(parsed[1].push_to_hub, parsed[1].hub_token)  # offline / no token: before any work
        from pf_trl.trainer.output_dir import refuse_uri_output_dir

        refuse_uri_output_dir(parsed[1].output_dir, prog)  # before a model or dataset is loaded
        run()(*parsed)
    except PfTrlError as exc:
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0
