"""`pf-trl torchrun [torchrun options] -m pf_trl.cli.main train ...`: torchrun, whose exit status is 2 when the
worker that failed first exited 2 (pf-trl's "bad input"), where torchrun says 1 (:mod:`pf_trl.parallel.launch`).
The options are torchrun's own, passed through unchanged."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from pf_trl.parallel.launch import run_torchrun

    return run_torchrun(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
