"""Reward-model training speed: TRL's RewardTrainer (padded) against PaddingFreeRewardTrainer on the same pairs.

Usage: python benchmarks/reward_throughput.py [--pairs 48] [--batch 8] [--max_length 512] [--repeats 3]
                                              [--threads 1] [--out benchmarks/results/reward_throughput.json]

Pairs of real, long-tailed lengths: a ShareGPT first turn (the shipped sample,
``pf_trl/data/samples/sharegpt_sample.jsonl``) as ``prompt`` + ``chosen``, the next row's response as ``rejected``.
The model is pf-trl's tiny Llama configuration (4 layers x 256, Mistral vocabulary 32,000) as
``LlamaForSequenceClassification`` (one label), float32, sdpa. Every mode trains one epoch over the same pairs:

- ``trl``: TRL's RewardTrainer, ``per_device_train_batch_size`` pairs a step, padded to the batch's longest;
- ``pf-fixed``: PaddingFreeRewardTrainer, the same pairs in the same steps (TRL's sampler), one packed row each;
- ``pf-budget``: PaddingFreeRewardTrainer with ``max_tokens_per_batch`` = batch x mean pair length (whole pairs).

Where a gain comes from: packing only (the backbone runs the real tokens; the score head, one linear map to one
label, is a negligible cost either way), so the ceiling is 1 / (1 - padding share of TRL's batches), less the
attention's and the fixed per-step costs. Measured by the same code (pf-trl's token metrics: real tokens /
train_runtime; peak RSS), modes in turn, reversed every other repeat; each speedup is the median of the per-repeat
ratios to TRL's run (min-max beside it). Prints a markdown table and writes the JSON.
"""

from __future__ import annotations

from offline import REPO  # before any HF import: offline hub, the checkout's import path

# isort: split

import argparse
import gc
import json
import logging
import statistics
import tempfile
import warnings
from pathlib import Path

import datasets
import torch
from preference_bench import interleaved, print_table, run_figures, sharegpt_pairs, summarize

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
datasets.disable_progress_bars()

MODES = ("trl", "pf-fixed", "pf-budget")


def _model():
    from transformers import AutoModelForSequenceClassification

    from pf_trl.models import embedded_config

    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(embedded_config("pf-trl/tiny-llama", num_labels=1),
                                                          attn_implementation="sdpa")


def _measured_trl_cls():
    from trl import RewardTrainer

    from pf_trl.trainer.accounting import TokenAccountingMixin

    class MeasuredRewardTrainer(TokenAccountingMixin, RewardTrainer):
        """Stock TRL RewardTrainer (padded) measured by the same code as pf-trl's."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._pf_init_metrics()

    return MeasuredRewardTrainer


def run(mode: str, pairs: list[dict], *, batch: int, max_length: int, budget: int, workdir: str) -> dict:
    from trl import RewardConfig

    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.trainer.preference import PaddingFreeRewardConfig, PaddingFreeRewardTrainer

    common = dict(output_dir=str(Path(workdir) / mode), report_to=[], save_strategy="no", use_cpu=True, seed=0,
                  per_device_train_batch_size=batch, num_train_epochs=1, max_length=max_length, logging_steps=1000,
                  disable_tqdm=True, learning_rate=1e-5, dataloader_num_workers=0, bf16=False)
    if mode == "trl":
        cls, args = _measured_trl_cls(), RewardConfig(**common)
    else:
        cls = PaddingFreeRewardTrainer
        args = PaddingFreeRewardConfig(**common, max_tokens_per_batch=budget if mode == "pf-budget" else None)
    trainer = cls(_model(), args=args, train_dataset=datasets.Dataset.from_list(pairs),
                  processing_class=load_tokenizer())
    out = run_figures(mode, trainer, trainer.train().metrics)
    del trainer
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)  # one thread: a shared machine's load skews more threads
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "reward_throughput.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from pf_trl.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    pairs = sharegpt_pairs(args.pairs)
    full = [(len(tok(p["prompt"] + p["chosen"])["input_ids"]), len(tok(p["prompt"] + p["rejected"])["input_ids"]))
            for p in pairs]
    kept = [c + r for c, r in full if c <= args.max_length and r <= args.max_length]  # TRL's max_length filter
    budget = max(int(args.batch * statistics.mean(kept)), 2 * args.max_length)  # any pair TRL keeps fits
    with tempfile.TemporaryDirectory() as workdir:
        runs = interleaved(MODES, args.repeats, lambda mode: run(mode, pairs, batch=args.batch,
                                                                 max_length=args.max_length, budget=budget,
                                                                 workdir=workdir))
    results = summarize(runs, MODES)
    report = dict(pairs=args.pairs, pairs_kept=len(kept), batch=args.batch, max_length=args.max_length,
                  token_budget=budget, threads=args.threads, repeats=args.repeats,
                  model="pf-trl/tiny-llama config as LlamaForSequenceClassification (4 x 256, vocab 32000, fp32, sdpa)",
                  torch=torch.__version__, results=results)
    print(f"\n{len(kept)} ShareGPT pairs (of {args.pairs}; TRL drops sequences over max_length {args.max_length}), "
          f"{args.batch} pairs a step (budget {budget} tokens), fp32, CPU {args.threads} thread(s), {args.repeats} "
          "interleaved repeats (median run; speedup: median of the per-repeat ratios, min-max)\n")
    print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
