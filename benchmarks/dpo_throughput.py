"""Preference training speed: TRL's DPOTrainer (padded) against PaddingFreeDPOTrainer on the same pairs.

Usage: python benchmarks/dpo_throughput.py [--pairs 24] [--batch 4] [--max_length 512] [--repeats 3]
                                           [--threads 1] [--bf16] [--out benchmarks/results/dpo_throughput.json]

Pairs of real lengths: the prompt and response of a ShareGPT first turn (the shipped sample,
``pf_trl/data/samples/sharegpt_sample.jsonl``) as ``prompt``/``chosen``, the next row's response as ``rejected``.
The model is pf-trl's tiny Llama (4 layers x 256, Mistral vocabulary 32,000, float32 weights, sdpa) with a separate
reference model, as TRL builds it; training runs in float32 (``bf16=False``), or with ``--bf16`` under bfloat16
autocast (the default of TRL's ``DPOConfig``). Every mode trains one epoch over the same pairs:

- ``trl``: TRL's DPOTrainer, ``per_device_train_batch_size`` pairs a step, padded;
- ``trl-completions``: the same, with TRL's LM head scoring only the positions whose label is kept, as it does on
  Triton devices (CUDA): ``trl.trainer.utils._use_triton`` reads true for the run, so TRL's head takes its compact
  path (its kernel still folds tiles with its torch fallback). Against it, ``pf-fixed-trl-head`` is packing alone;
- ``pf-fixed``: PaddingFreeDPOTrainer, the same pairs in the same steps (TRL's sampler), one packed row each;
- ``pf-fixed-trl-head``: the same, with TRL's own LM-head kernel on the completion tokens instead of pf-trl's CPU
  head (``install_packed_preference_forward(..., head="trl")``): what packing and scoring fewer tokens give alone;
- ``pf-budget``: PaddingFreeDPOTrainer with ``max_tokens_per_batch`` = batch x mean pair length (whole pairs).

Measured by the same code (pf-trl's token metrics: real tokens / train_runtime; peak RSS during training). The modes
run in turn, ``--repeats`` times, in reversed order every other repeat, so that each repeat compares runs made
minutes apart on the same (possibly shared) machine: every speedup is the median over the repeats of the ratio
within a repeat (min and max beside it). Prints a markdown table and writes the JSON.
"""

from __future__ import annotations

from offline import REPO  # before any HF import: offline hub, the checkout's import path

# isort: split

import argparse
import gc
import json
import logging
import tempfile
import warnings
from pathlib import Path

import datasets
import torch
from preference_bench import compact_trl_head, interleaved, print_table, run_figures, sharegpt_pairs, summarize

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
datasets.disable_progress_bars()


def run(mode: str, pairs: list[dict], *, batch: int, max_length: int, budget: int | None, workdir: str,
        bf16: bool = False) -> dict:
    from trl import DPOConfig

    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.models import build_model
    from pf_trl.trainer.accounting import MeasuredDPOTrainer
    from pf_trl.trainer.dpo_config import PaddingFreeDPOConfig
    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    common = dict(output_dir=str(Path(workdir) / mode), report_to=[], save_strategy="no", use_cpu=True, seed=0,
                  per_device_train_batch_size=batch, num_train_epochs=1, max_length=max_length, logging_steps=1000,
                  disable_tqdm=True, learning_rate=1e-5, dataloader_num_workers=0, bf16=bf16)
    if mode in ("trl", "trl-completions"):
        cls, args = MeasuredDPOTrainer, DPOConfig(**common)
    else:
        cls = PaddingFreeDPOTrainer
        args = PaddingFreeDPOConfig(**common, max_tokens_per_batch=budget if mode == "pf-budget" else None)
    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0)
    ref = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0)
    trainer = cls(model, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(pairs),
                  processing_class=load_tokenizer())
    if mode == "pf-fixed-trl-head":
        from pf_trl.trainer.dpo_forward import install_packed_preference_forward

        install_packed_preference_forward(model, trainer._pf_policy_fields(), head="trl")
        install_packed_preference_forward(ref, ("log_probs",), head="trl")
    with compact_trl_head(mode == "trl-completions"):  # TRL's CUDA behaviour on CPU: only labelled positions
        metrics = trainer.train().metrics
    out = run_figures(mode, trainer, metrics)
    del trainer, model, ref
    gc.collect()
    return out


MODES = ("trl", "trl-completions", "pf-fixed", "pf-fixed-trl-head", "pf-budget")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=24)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    # one thread by default: on a small shared machine a second thread measures the other jobs' load (a parallel
    # region waits for its slowest thread) more than the trainers
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast (TRL's DPOConfig default)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)} (trl "
                        "always runs)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "dpo_throughput.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    modes = tuple(m for m in MODES if m == "trl" or m in args.modes.split(","))
    pairs = sharegpt_pairs(args.pairs)
    from pf_trl.batching.preference import pair_lengths
    from pf_trl.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    lengths = pair_lengths([len(tok(p["prompt"])["input_ids"]) for p in pairs],
                           [len(tok(p["chosen"])["input_ids"]) for p in pairs],
                           [len(tok(p["rejected"])["input_ids"]) for p in pairs], max_length=args.max_length)
    budget = max(int(args.batch * lengths.mean()), int(lengths.max()))
    with tempfile.TemporaryDirectory() as workdir:
        runs = interleaved(modes, args.repeats, lambda mode: run(mode, pairs, batch=args.batch,
                                                                 max_length=args.max_length, budget=budget,
                                                                 workdir=workdir, bf16=args.bf16))
    results = summarize(runs, modes)
    report = dict(pairs=args.pairs, batch=args.batch, max_length=args.max_length, token_budget=budget,
                  threads=args.threads, repeats=args.repeats,
                  model="pf-trl/tiny-llama (4 x 256, vocab 32000, fp32 weights, sdpa)",
                  precision="bf16 autocast" if args.bf16 else "fp32", torch=torch.__version__,
                  results=results)
    print(f"\n{args.pairs} ShareGPT pairs, {args.batch} pairs a step (budget {budget} tokens), max_length "
          f"{args.max_length}, {'bf16 autocast' if args.bf16 else 'fp32'}, CPU {args.threads} threads, "
          f"{args.repeats} interleaved repeats (median run; speedup: "
          "median of the per-repeat ratios, min-max)\n")
    print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
