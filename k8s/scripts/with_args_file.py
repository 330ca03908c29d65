"""Run a command with more arguments read from a file: the seed's `pf-trl train` flags live in a ConfigMap.

    python with_args_file.py ARGS_FILE COMMAND [ARG ...]

runs ``COMMAND ARG ... <arguments of ARGS_FILE>`` (exec: same PID, signals and exit status). The file is
split like a POSIX shell line (``shlex``: quotes keep ``'### Response:'`` one argument, ``#`` starts a
comment, newlines are plain separators); no variable expansion, no globbing.

Kept out of the images on purpose (mounted from the ``pf-trl-scripts`` ConfigMap): it is deployment glue.
If ``pf-trl train`` grows an ``--args_file``/``@file`` option this script can go.
"""

from __future__ import annotations

import os
import shlex
import sys


def read_args_file(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return shlex.split(f.read(), comments=True, posix=True)


def build_argv(argv: list[str]) -> list[str]:
    """``[ARGS_FILE, COMMAND, ARG...]`` -> the command line to exec."""
    if len(argv) < 2:
        raise SystemExit("usage: with_args_file.py ARGS_FILE COMMAND [ARG ...]")
    path, command = argv[0], argv[1:]
    return [*command, *read_args_file(path)]


def main(argv: list[str] | None = None) -> None:
    cmd = build_argv(list(sys.argv[1:] if argv is None else argv))
    print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
