"""`pf-trl` entry point: dispatches to the subcommand modules (imported lazily: `serve` needs FastAPI,
`train` needs TRL; neither is imported for `pf-trl pretokenize`)."""

from __future__ import annotations

import importlib
import sys

from pf_trl._version import __version__

COMMANDS = {
    "train": ("pf_trl.cli.train", "fine-tune with TRL's SFTTrainer, padding-free"),
    "dpo": ("pf_trl.cli.dpo", "preference training (TRL's DPOTrainer), padding-free; the flags of `trl dpo`"),
    "reward": ("pf_trl.cli.reward", "reward models (TRL's RewardTrainer), padding-free; the flags of `trl reward`"),
    "kto": ("pf_trl.cli.kto", "KTO (TRL's KTOTrainer), padding-free, unpaired desirable / undesirable rows; the "
            "flags of `trl kto`"),
    "grpo": ("pf_trl.cli.grpo", "GRPO (TRL's GRPOTrainer), padding-free, one prompt per group; `trl grpo`'s flags"),
    "rloo": ("pf_trl.cli.rloo", "RLOO (TRL's RLOOTrainer), padding-free, one prompt per group; `trl rloo`'s flags"),
    "pretokenize": ("pf_trl.cli.pretokenize", "tokenize a dataset into a shards directory"),
    "inspect": ("pf_trl.cli.inspect", "print the manifest and packing statistics of a shards directory"),
    "verify": ("pf_trl.cli.verify", "check shards directories against their manifests' checksums"),
    "serve": ("pf_trl.cli.serve", "run the preprocessing service (FastAPI)"),
    "bench": ("pf_trl.cli.bench", "padded vs TRL padding-free vs pf-trl, side by side"),
    "demo": ("pf_trl.cli.demo", "pretokenize the shipped sample and train the tiny default a few steps"),
    "torchrun": ("pf_trl.cli.torchrun", "torchrun, exiting 2 when a worker exited 2 (bad input: no retry)"),
}

# `serve` spells its flags with dashes and accepts underscores itself.
UNDERSCORE_COMMANDS = ("train", "pretokenize", "inspect", "demo", "bench", "verify")


def usage() -> str:
    lines = [f"pf-trl {__version__}: padding-free fine-tuning for TRL", "", "usage: pf-trl COMMAND [options]", ""]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`pf-trl COMMAND --help` shows the options of a command."]
    return "\n".join(lines)


LONG_LIVED_COMMANDS = frozenset({"serve"})


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"pf-trl: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if name in UNDERSCORE_COMMANDS:  # their flags are spelled with underscores; dashes are accepted too
        from pf_trl.cli.flags import FlagAliasError, normalize_flags, one_line

        try:
            rest = normalize_flags(rest, command=name)  # the one alias table, rows of this command included
        except FlagAliasError as exc:
            print(f"pf-trl {name}: error: {one_line(exc)}", file=sys.stderr)
            return 2
    module = importlib.import_module(COMMANDS[name][0])
    if name in LONG_LIVED_COMMANDS:  # a service resolves each request's Hub revision anew
        return int(module.main(rest) or 0)
    from pf_trl.hub import one_commit_per_repository

    with one_commit_per_repository():  # a run reads every Hub repository at the one commit it resolved first
        return int(module.main(rest) or 0)


def run() -> int:
    """The ``pf-trl`` command: :func:`main`, then, in a process that ends after a successful command under
    torch.distributed, every rank leaves together (:func:`pf_trl.parallel.launch.leave_process_group`). Kept out of
    :func:`main` so that a Python caller may run several commands in one process group."""
    status = main()
    if status == 0 and "torch" in sys.modules:  # nothing to tear down where torch was never imported
        from pf_trl.parallel.launch import leave_process_group

        leave_process_group()
    return status


if __name__ == "__main__":
    sys.exit(run())
