"""Run a command whose arguments include those of a file: the shared `pf-trl train` flags live in a ConfigMap.

    python with_args_file.py COMMAND [ARG | @FILE ...]

runs ``COMMAND ARG ...`` with every argument ``@FILE`` (an absolute path: ``@/etc/...``) replaced, in place, by
the arguments written in FILE (exec: same PID, signals and exit status). FILE is split like a POSIX shell line
(``shlex``: quotes keep ``'### Response:'`` one argument, ``#`` starts a comment, newlines are plain separators); no
variable expansion, no globbing.

Where a flag is given twice, the later one wins (`pf-trl train` parses the command line left to right), so the
templates put ``@/etc/pf-trl/train/train.args`` (the ConfigMap's flags, shared by every job) right after
``train`` and the job's own flags after it: a flag in a job's ``args`` overrides the ConfigMap's. The line printed
before the exec names each flag given in both places.

Kept out of the images on purpose (mounted from the ``pf-trl-scripts`` ConfigMap): it is deployment glue.
"""

from __future__ import annotations

import os
import shlex
import sys


def read_args_file(path: str) -> list[str]:
    """The arguments written in ``path`` (shell-quoted, ``#`` comments)."""
    with open(path, encoding="utf-8") as f:
        return shlex.split(f.read(), comments=True, posix=True)


def _flag(arg: str) -> str | None:
    if not arg.startswith("--") or len(arg) == 2:
        return None
    return arg[2:].split("=", 1)[0].replace("-", "_")


def build_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``[COMMAND, ARG | @FILE ...]`` -> (the command line to exec, the flags a later argument overrides)."""
    if not argv or argv[0].startswith("@"):
        raise SystemExit("usage: with_args_file.py COMMAND [ARG | @FILE ...] (@FILE: an absolute path)")
    out: list[str] = []
    from_file: set[str] = set()
    overridden: list[str] = []
    for arg in argv:
        if arg.startswith("@/"):
            path = arg[1:]
            if not os.path.isfile(path):
                raise SystemExit(f"with_args_file.py: {path} does not exist (is its ConfigMap mounted there?)")
            spliced = read_args_file(path)
            from_file |= {f for f in map(_flag, spliced) if f}
            out += spliced
            continue
        flag = _flag(arg)
        if flag in from_file and flag not in overridden:
            overridden.append(flag)
        out.append(arg)
    return out, overridden


def main(argv: list[str] | None = None) -> None:
    cmd, overridden = build_argv(list(sys.argv[1:] if argv is None else argv))
    note = f"  # the job's args override the file's --{', --'.join(overridden)}" if overridden else ""
    print("+ " + shlex.join(cmd) + note, file=sys.stderr, flush=True)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
