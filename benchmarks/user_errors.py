"""How fast, and how alone, a user error of `pf-trl train` / `pretokenize` answers: this checkout against an older
pf-trl (a git ref), interleaved case by case so that machine load hits both alike.

    python benchmarks/user_errors.py --before 20986ad --repeats 2

Each case runs `python -m pf_trl.cli.main ...` as a fresh process (the user's view: imports included) with
PYTHONPATH pointing at either source tree, and records the exit status, the wall time, the lines on stderr and
whether a reader's "row N" log line came before pf-trl's own. Prints a table; writes
benchmarks/results/user_errors.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = "num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,num_key_value_heads=1"


def make_inputs(work: Path) -> dict[str, list[str]]:
    work.mkdir(parents=True)
    rows = [{"instruction": f"Say {i} " * 20, "input": "", "output": f"Number {i}."} for i in range(300)]
    good = work / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = [json.dumps(r) for r in rows]
    lines.insert(56, '{"instruction": "broken" "output": "x"}')  # line 57
    bad = work / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    (work / "out" / "checkpoint-2").mkdir(parents=True)
    train = ["train", "--training_data_path", str(good), "--output_dir", str(work / "fresh")]
    return {
        "missing file (reference)": ["train", "--training_data_path", str(work / "nope.jsonl")],
        "typo'd flag (--learnin_rate)": [*train, "--learnin_rate", "1e-4"],
        "prefix of a flag (--model_name_or_pat)": [*train, "--model_name_or_pat", "x"],
        "bad value (--max_steps abc)": [*train, "--max_steps", "abc"],
        "bad JSONL line (train)": ["train", "--training_data_path", str(bad), "--output_dir", str(work / "fresh")],
        "bad JSONL line (pretokenize)": ["pretokenize", str(bad), str(work / "shards"), "--no_progress"],
        "output_dir with checkpoint-2, no resume": [
            "train", "--training_data_path", str(good), "--output_dir", str(work / "out"), "--model_overrides", TINY,
            "--max_steps", "1", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "True"],
    }


def run(tree: Path, argv: list[str], cache: Path, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "PF_TRL_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pf_trl.cli.main", *argv], capture_output=True, text=True,
                              env=env, timeout=timeout, cwd=tree)
        rc, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, err = "timeout", (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    seconds = time.perf_counter() - t0
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line and "%|" not in line]
    return {"rc": rc, "seconds": round(seconds, 2), "stderr_lines": len(lines), "row_log": "in row " in err,
            "last_line": lines[-1][:240] if lines else ""}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--before", required=True, help="git ref of the older pf-trl")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "user_errors.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pf-user-errors-") as tmp:
        tmp = Path(tmp)
        old = tmp / "before"
        old.mkdir()
        archive = subprocess.run(["git", "archive", args.before], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        trees = {"before": old, "after": ROOT}
        for version, tree in trees.items():  # warm-up, not timed: the embedded tokenizer is converted once per cache
            warm = tmp / f"warm-{version}"
            make_inputs(warm)
            run(tree, ["pretokenize", str(warm / "good.jsonl"), str(warm / "shards"), "--no_progress"],
                tmp / f"cache-{version}", args.timeout)
        raw: dict[str, dict[str, list[dict]]] = {}
        for repeat in range(args.repeats):
            cases = {version: make_inputs(tmp / f"run-{repeat}-{version}") for version in trees}
            order = ("before", "after") if repeat % 2 == 0 else ("after", "before")
            for case in cases["after"]:
                for version in order:  # interleaved: each case runs in both versions back to back
                    result = run(trees[version], cases[version][case], tmp / f"cache-{version}", args.timeout)
                    raw.setdefault(case, {}).setdefault(version, []).append(result)
                    print(f"[{repeat}] {version:6s} {case}: rc {result['rc']} {result['seconds']} s", flush=True)
    rows = []
    for case, by in raw.items():
        b, a = by["before"], by["after"]
        mb, ma = statistics.median(r["seconds"] for r in b), statistics.median(r["seconds"] for r in a)
        rows.append({"case": case, "before_rc": b[-1]["rc"], "before_s": mb, "before_stderr_lines": b[-1]["stderr_lines"],
                     "before_row_log": any(r["row_log"] for r in b), "before_last_line": b[-1]["last_line"],
                     "after_rc": a[-1]["rc"], "after_s": ma, "after_stderr_lines": a[-1]["stderr_lines"],
                     "after_row_log": any(r["row_log"] for r in a), "after_last_line": a[-1]["last_line"],
                     "speedup": round(mb / ma, 1) if ma else None})
    print()
    print("| case | before: exit, s (median), stderr lines | after: exit, s (median), stderr lines | before / after |")
    print("|---|---|---|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['before_rc']}, {r['before_s']:.1f} s, {r['before_stderr_lines']}"
              f"{' (row-N log first)' if r['before_row_log'] else ''} | {r['after_rc']}, {r['after_s']:.1f} s, "
              f"{r['after_stderr_lines']}{' (row-N log first)' if r['after_row_log'] else ''} | {r['speedup']}x |")
    load = os.getloadavg()
    body = {"before": args.before, "repeats": args.repeats, "machine": {"cpus": os.cpu_count(), "load_avg": load,
                                                                      "python": platform.python_version()},
            "rows": rows, "raw": raw}
    Path(args.output).write_text(json.dumps(body, indent=2) + "\n")
    print(f"\nwrote {args.output} (load average {load[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
