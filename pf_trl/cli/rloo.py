"""`pf-trl rloo`: RLOO with TRL's RLOOTrainer, padding-free; the flags of `trl rloo` (:mod:`pf_trl.cli.rl`)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from pf_trl.cli.rl import main as rl_main

    return rl_main("rloo", argv)


if __name__ == "__main__":
    sys.exit(main())
