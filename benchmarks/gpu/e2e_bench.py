"""End-to-end training throughput on one GPU, steady state: TRL padded / TRL padding-free / pf-trl arms.

    python benchmarks/gpu/e2e_bench.py [--preset llama1b|seed7b] [--out DIR] [--deadline-s S] [--dry-run]

``llama1b``: the ~1.1B Llama (bf16 weights, random init), ShareGPT multi-turn row shapes (every arm of
:mod:`pf_trl.benchmarking.arms`, or ``--arms``) and ShareGPT first turns in an Alpaca-style template (the padded / TRL
padding-free / pf-trl arms), batch 8, ``--repeats`` rounds with the arm order rotated, per arm 3 warm-up steps then
``--min-steps`` timed steps or ``--min-seconds``, whichever first. Writes ``e2e_llama1b_<set>.json``.
``seed7b``: the seed's experiment as the seed ran it, a Mistral-7B-shaped model (bf16 weights, random init),
batch 4, 100 steps over 400 rows, activation checkpointing, AdamW (``adamw_torch`` on bf16 weights: its states are
bf16, as in fms-acceleration's benchmark, which leaves the optimizer at the Trainer's default): TRL padded, the
same batches with the padding removed (``pf-trl-same-batches``), and pf-trl's token budget over the same rows.
The rows are ShareGPT first turns in an Alpaca-style template, not Alpaca (none ships here). Writes
``e2e_seed7b.json``. Each arm runs once (its 100 steps are the measurement): ``--repeats``, ``--min-steps``,
``--min-seconds``, ``--repeat-arms``, ``--round-offset``, ``--datasets`` and ``--tag`` are refused with it.
``--merge A.json B.json``: one report from two calls' reports of the same bench (rounds continued with
``--round-offset``), written to ``--out``.
``--dry-run``: the same code paths on CPU with a tiny Llama in float32 and a few steps (a test runs it).
Every flag is honoured or refused in one line (exit 2).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512)


LLAMA1B_DEFAULTS = dict(repeats=2, min_steps=100, min_seconds=60.0, round_offset=0)
SEED_ONLY_REFUSED = ("repeats", "min_steps", "min_seconds", "repeat_arms", "round_offset", "datasets", "tag")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--preset", choices=("llama1b", "seed7b"), default="llama1b")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="seconds from now: start no arm that would end after them (default: no deadline)")
    parser.add_argument("--repeats", type=int, default=None, help="llama1b: rounds (default 2)")
    parser.add_argument("--round-offset", type=int, default=None,
                        help="llama1b: index of the first round (a second call continuing a first call's rounds)")
    parser.add_argument("--min-steps", type=int, default=None, help="llama1b: timed steps per arm (default 100)")
    parser.add_argument("--min-seconds", type=float, default=None, help="llama1b: or this many seconds (default 60)")
    parser.add_argument("--arms", default=None, help="comma-separated subset, in this order (default: all)")
    parser.add_argument("--repeat-arms", default=None,
                        help="llama1b: comma-separated arms of the rounds after the first (default: every arm)")
    parser.add_argument("--datasets", default=None,
                        help="llama1b: which row-shape sets, comma-separated (one JSON each; default: both)")
    parser.add_argument("--tag", default=None, help="llama1b: the JSON's name ends _<tag>.json")
    parser.add_argument("--merge", nargs="+", type=Path, default=None, help="reports to merge into --out")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)

    from pf_trl.benchmarking.arms import ARMS, SEED_ARMS

    if args.deadline_s is not None and args.deadline_s <= 0:
        parser.error(f"--deadline-s {args.deadline_s:g}: no time to run any arm; give a positive number of seconds, "
                     "or leave it out for no deadline")
    known = SEED_ARMS if args.preset == "seed7b" else ARMS
    arms = None
    if args.arms is not None:
        arms = [a.strip() for a in args.arms.split(",") if a.strip()]
        bad = [a for a in arms if a not in known]
        if bad or not arms:
            parser.error(f"--arms: unknown arm(s) {bad or [args.arms]} for --preset {args.preset}; choose from "
                         f"{', '.join(known)}")
    if args.repeat_arms is not None:
        bad = [a.strip() for a in args.repeat_arms.split(",") if a.strip() not in ARMS]
        if bad:
            parser.error(f"--repeat-arms: unknown arm(s) {bad}; choose from {', '.join(ARMS)}")
    for name, value in (("repeats", args.repeats), ("min_steps", args.min_steps), ("min_seconds", args.min_seconds)):
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} {value:g}: must be positive")
    if args.round_offset is not None and args.round_offset < 0:
        parser.error(f"--round-offset {args.round_offset}: must be 0 or more")
    if args.merge:
        return merge(args.merge, args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.deadline_s if args.deadline_s is not None else None
    if args.preset == "seed7b":
        given = [f"--{n.replace('_', '-')}" for n in SEED_ONLY_REFUSED if getattr(args, n) is not None]
        if given:
            parser.error(f"{' '.join(given)}: the seed experiment runs each arm once over its 100 steps; drop "
                         f"{'it' if len(given) == 1 else 'them'} (they apply to --preset llama1b)")
        return seed(args, arms or list(SEED_ARMS), deadline)
    for name, value in LLAMA1B_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return llama1b(args, parser, arms or list(ARMS), deadline)


def seed(args, arms: list[str], deadline: float | None) -> int:
    import torch

    from pf_trl.benchmarking.arms import BenchSetup
    from pf_trl.benchmarking.e2e import seed_experiment

    cuda = torch.cuda.is_available() and not args.dry_run
    setup = BenchSetup(model="pf-trl/mistral-7b", batch_size=4, activation_checkpointing=True)
    steps = 100
    if args.dry_run:
        setup = BenchSetup(model="pf-trl/mistral-7b", dtype="float32", batch_size=4, activation_checkpointing=True,
                           model_overrides=TINY)
        steps = 3
    report = seed_experiment(setup, dataset="alpaca_template", steps=steps, cuda=cuda, arms=tuple(arms),
                             out_path=args.out / "e2e_seed7b.json", warmup_steps=1 if args.dry_run else 3,
                             max_len=256 if args.dry_run else None, deadline=deadline)
    print(f"data: {report['data']['what']}; {report['rows']} rows, mean {report['mean_length']} tokens")
    print("| arm | optimizer steps | examples / step | runtime, all steps (s) | real tok/s | MFU | HFU | GPU (GB) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in report["runs"]:
        s = r.get("summary") or {}
        print(f"| {r['arm']} | {r.get('optimizer_steps', '-')} | {r.get('examples_per_step', '-')} | "
              f"{r.get('runtime_all_steps_s', r.get('error') or r.get('skipped'))} | "
              f"{s.get('real_tokens_per_second')} | {s.get('mfu')} | {s.get('hfu')} | "
              f"{s.get('gpu_max_allocated_gb')} |")
    print(f"seed experiment, padding removed (same {report['optimizer_steps']} steps of {report['examples_per_step']} "
          f"rows): speedup {report.get('speedup_runtime')}, same batches {report.get('same_batches')}; with pf-trl's "
          f"token budget: {report.get('speedup_token_budget')}. The seed: 1.37x on Alpaca; here other rows (see "
          "comparison_with_seed in the JSON)")
    failed = [f"{r['arm']}: {r['error']}" for r in report["runs"] if "error" in r]
    for line in failed:
        print(f"seed: FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


def llama1b(args, parser, arms: list[str], deadline: float | None) -> int:
    import torch

    from pf_trl.benchmarking.arms import BenchSetup
    from pf_trl.benchmarking.e2e import bench

    cuda = torch.cuda.is_available() and not args.dry_run
    every = {"sharegpt_multiturn": arms,
             "alpaca_template": [a for a in arms if a in ("trl-padded", "pf-trl", "trl-pf-sdpa")]}
    repeat_arms = [a.strip() for a in args.repeat_arms.split(",")] if args.repeat_arms else None
    failed = []
    names = [d.strip() for d in (args.datasets or ",".join(every)).split(",") if d.strip()]
    for name in names:
        if name not in every:
            parser.error(f"--datasets: unknown set {name!r}; choose from {sorted(every)}")
    for name in names:
        tag = args.tag or (f"round{args.round_offset + 1}" if args.round_offset else "")
        suffix = f"_{tag}" if tag else ""
        out_path = args.out / f"e2e_llama1b_{name}{suffix}.json"
        if args.dry_run:
            setup = BenchSetup(model="pf-trl/llama-1b", dtype="float32", batch_size=2, model_overrides=TINY,
                               compile_backend="eager")  # dynamo's tracing without inductor's minute of CPU codegen
            report = bench(setup, datasets={name: every[name]}, repeats=args.repeats, rows_per_dataset=24,
                           warmup_steps=1, min_steps=min(args.min_steps, 2), min_seconds=args.min_seconds,
                           cuda=False, out_path=out_path, deadline=deadline, max_len=128, repeat_arms=repeat_arms,
                           round_offset=args.round_offset)
        else:
            setup = BenchSetup(model="pf-trl/llama-1b", batch_size=8)
            report = bench(setup, datasets={name: every[name]}, repeats=args.repeats, rows_per_dataset=2000,
                           warmup_steps=3, min_steps=args.min_steps, min_seconds=args.min_seconds, cuda=cuda,
                           out_path=out_path, deadline=deadline, repeat_arms=repeat_arms,
                           round_offset=args.round_offset)
        print(report["table_markdown"])
        if report.get("cut_short"):
            print(f"e2e: cut short: {report['cut_short']}")
        failed += [f"{r['dataset']}/{r['arm']}: {r['error']}" for r in report["runs"] if "error" in r]
    for line in failed:
        print(f"e2e: FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


def merge(paths: list[Path], out: Path) -> int:
    import json

    from pf_trl.benchmarking.e2e import merge_reports

    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"e2e_bench: --merge: {', '.join(missing)} missing", file=sys.stderr)
        return 2
    merged = merge_reports([json.loads(p.read_text()) for p in paths])
    target = out if out.suffix == ".json" else out / f"{paths[0].stem}_merged.json"  # never over an input
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(merged, indent=1))
    print(merged["table_markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
