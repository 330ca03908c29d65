"""End-to-end training throughput on one GPU, steady state: TRL padded / TRL padding-free / pf-trl arms.

    python benchmarks/gpu/e2e_bench.py [--preset llama1b|seed7b] [--out DIR] [--deadline-s S] [--dry-run]

``llama1b``: the ~1.1B Llama (bf16 weights, random init), ShareGPT multi-turn row shapes (every arm of
:mod:`pf_trl.benchmarking.arms`) and Alpaca-template row shapes (the padded / TRL padding-free / pf-trl arms),
batch 8, two rounds with the arm order rotated, per arm 3 warm-up steps then 100 timed steps or 60 s, whichever
first. Writes ``e2e_llama1b.json``.
``seed7b``: the seed's experiment, a Mistral-7B-shaped model (bf16 weights, random init), Alpaca-template rows,
batch 4, 100 padded steps vs pf-trl over the same 400 rows, activation checkpointing, AdamW (``adamw_torch`` on
bf16 weights: its states are bf16, as in fms-acceleration's benchmark, which leaves the optimizer at the
Trainer's default). Writes ``e2e_seed7b.json``.
``--dry-run``: the same code paths on CPU with a tiny Llama in float32 and a few steps (a test runs it).
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("llama1b", "seed7b"), default="llama1b")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--deadline-s", type=float, default=None, help="start no new arm after this many seconds")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--min-steps", type=int, default=100)
    parser.add_argument("--min-seconds", type=float, default=60.0)
    parser.add_argument("--arms", default=None, help="comma-separated subset for the ShareGPT set (default: all)")
    parser.add_argument("--repeat-arms", default=None,
                        help="comma-separated arms that run in the rounds after the first (default: every arm)")
    parser.add_argument("--datasets", default="sharegpt_multiturn,alpaca_template",
                        help="llama1b: which row-shape sets, comma-separated (one JSON each)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from pf_trl.benchmarking.arms import ARMS, BenchSetup
    from pf_trl.benchmarking.e2e import bench, seed_experiment

    cuda = torch.cuda.is_available() and not args.dry_run
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.deadline_s if args.deadline_s else None
    if args.preset == "seed7b":
        setup = BenchSetup(model="pf-trl/mistral-7b", batch_size=4, activation_checkpointing=True)
        steps = 100
        if args.dry_run:
            setup = BenchSetup(model="pf-trl/mistral-7b", dtype="float32", batch_size=4, activation_checkpointing=True,
                               model_overrides=TINY)
            steps = 3
        report = seed_experiment(setup, dataset="alpaca_template", steps=steps, cuda=cuda,
                                 out_path=args.out / "e2e_seed7b.json", warmup_steps=1 if args.dry_run else 3,
                                 max_len=256 if args.dry_run else None)
        for r in report["runs"]:
            s = r.get("summary") or {}
            print(f"| {r['arm']} | {r.get('runtime_all_steps_s', r.get('error') or r.get('skipped'))} s | "
                  f"{s.get('real_tokens_per_second')} tok/s | MFU {s.get('mfu')} | "
                  f"GPU {s.get('gpu_max_allocated_gb')} GB |")
        print(f"seed experiment: speedup {report.get('speedup_runtime')} (the seed: 1.37x), same tokens "
              f"{report.get('same_tokens')}")
        return 0 if "speedup_runtime" in report else 1
    arms = [a.strip() for a in args.arms.split(",")] if args.arms else list(ARMS)
    every = {"sharegpt_multiturn": arms, "alpaca_template": ["trl-padded", "pf-trl", "trl-pf-sdpa"]}
    repeat_arms = [a.strip() for a in args.repeat_arms.split(",")] if args.repeat_arms else None
    failed = []
    for name in [d.strip() for d in args.datasets.split(",") if d.strip()]:
        if name not in every:
            parser.error(f"--datasets: unknown set {name!r}; choose from {sorted(every)}")
        out_path = args.out / f"e2e_llama1b_{name}.json"
        if args.dry_run:
            setup = BenchSetup(model="pf-trl/llama-1b", dtype="float32", batch_size=2, model_overrides=TINY,
                               compile_backend="eager")  # dynamo's tracing without inductor's minute of CPU codegen
            report = bench(setup, datasets={name: every[name]}, repeats=args.repeats, rows_per_dataset=24,
                           warmup_steps=1, min_steps=2, min_seconds=60.0, cuda=False, out_path=out_path,
                           deadline=deadline, max_len=128, repeat_arms=repeat_arms)
        else:
            setup = BenchSetup(model="pf-trl/llama-1b", batch_size=8)
            report = bench(setup, datasets={name: every[name]}, repeats=args.repeats, rows_per_dataset=2000,
                           warmup_steps=3, min_steps=args.min_steps, min_seconds=args.min_seconds, cuda=cuda,
                           out_path=out_path, deadline=deadline, repeat_arms=repeat_arms)
        print(report["table_markdown"])
        failed += [f"{r['dataset']}/{r['arm']}: {r['error']}" for r in report["runs"] if "error" in r]
    for line in failed:
        print(f"e2e: FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
