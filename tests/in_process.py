"""``pf-trl <command> ...`` run in the test's own process: the console script's entry (``pf_trl.cli.main.main``, whose
return value the script exits with) under the environment and working folder a node's process would have.

A new interpreter imports torch, transformers and TRL again (~4 CPU-seconds on CI's machine) before doing anything;
the object-storage tests start dozens of commands, so those whose claim is about the command, not about a process of
its own (killed, or running beside another), run here. What a subprocess gives them is kept: the exit code, stderr
(where a refusal's one line goes), an environment of its own (the AWS chain, ``PF_TRL_CACHE``) and a clean slate of
cached filesystems and read-ahead threads before and after.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
from pathlib import Path


def run_cli(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """``argv`` without the ``pf-trl`` program name, run with ``os.environ`` = ``env`` in ``cwd``; what
    ``subprocess.run(..., capture_output=True, text=True)`` would return."""
    from pf_trl.cli.main import main
    from pf_trl.storage import filesystem, readahead

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    filesystem.forget_filesystems()  # the client reads the AWS chain when made: this command's, not the last one's
    said = logging.StreamHandler(err)  # warnings, as Python's last-resort handler prints them in a process of its own
    said.setLevel(logging.WARNING)
    logging.getLogger().addHandler(said)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = int(main([str(a) for a in argv]) or 0)
            except SystemExit as exc:  # argparse's refusals: the status (and message) a process would exit with
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr)
    finally:
        logging.getLogger().removeHandler(said)
        readahead.close_all()
        filesystem.forget_filesystems()
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["pf-trl", *argv], code, out.getvalue(), err.getvalue())
