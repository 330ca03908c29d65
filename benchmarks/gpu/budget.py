"""The run book's device budget from its two dry runs (pf_trl.benchmarking.budget): a table per stage, margins.

    OUT=/tmp/c1 STAGES='fa4stash sharegpt seed' DEADLINE_S=440 bash benchmarks/gpu/run_all.sh --dry-run
    OUT=/tmp/c2 STAGES='sharegpt2 fa4 best 1 5 alpaca extras' DEADLINE_S=190 bash benchmarks/gpu/run_all.sh --dry-run
    python benchmarks/gpu/budget.py /tmp/c1 /tmp/c2 [--json budget.json]

The stages and deadlines of each call are pf_trl.benchmarking.budget.CALLS'; exit 1 when a call's planned stages do
not fit before its deadline, or the window has no margin.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dry_runs", nargs=2, type=Path, help="the $OUT of call 1's and call 2's dry runs")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from pf_trl.benchmarking.budget import budget_table, format_budget

    for out in args.dry_runs:
        if not (out / "stage_seconds.tsv").is_file():
            parser.error(f"{out}/stage_seconds.tsv is missing: run run_all.sh --dry-run with OUT={out} first")
    budget = budget_table(args.dry_runs)
    print(format_budget(budget))
    if args.json:
        args.json.write_text(json.dumps(budget, indent=1))
    fits = all(c["margin_s"] >= 0 for c in budget["calls"])
    return 0 if fits and budget["window_margin_worst_case_s"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
