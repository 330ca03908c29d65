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

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
datasets.disable_progress_bars()

MODES = ("trl", "pf-fixed", "pf-budget")


def sharegpt_pairs(n: int) -> list[dict]:
    from pf_trl.data.samples import SHAREGPT_SAMPLE

    rows = [json.loads(line) for line in SHAREGPT_SAMPLE.read_text().splitlines()[: n + 1]]
    return [dict(prompt=rows[i]["prompt"], chosen=rows[i]["completion"], rejected=rows[i + 1]["completion"])
            for i in range(n)]


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
    metrics = trainer.train().metrics
    out = dict(mode=mode, runtime_s=metrics["train_runtime"], steps=trainer.state.global_step,
               real_tokens=metrics["train_real_tokens"], processed_tokens=metrics["train_processed_tokens"],
               real_tokens_per_s=metrics["train_real_tokens"] / metrics["train_runtime"],
               padding_share=metrics["train_padding_share"], peak_rss_mb=metrics["train_mem_cpu_peak"] / 2**20,
               train_loss=metrics["train_loss"])
    del trainer
    gc.collect()
    return out


def summarize(runs: list[list[dict]]) -> list[dict]:
    """Per mode: the median run (by real tokens/s) and the speedups over TRL's run of the same repeat."""
    out = []
    for mode in MODES:
        mine = [next(r for r in rep if r["mode"] == mode) for rep in runs]
        trl = [next(r for r in rep if r["mode"] == "trl") for rep in runs]
        ratios = sorted(m["real_tokens_per_s"] / t["real_tokens_per_s"] for m, t in zip(mine, trl))
        memory = [m["peak_rss_mb"] / t["peak_rss_mb"] for m, t in zip(mine, trl)]
        median = sorted(mine, key=lambda r: r["real_tokens_per_s"])[len(mine) // 2]
        out.append(dict(median, speedup_vs_trl=statistics.median(ratios), speedup_min=ratios[0],
                        speedup_max=ratios[-1], speedups=ratios, peak_rss_vs_trl=statistics.median(memory),
                        runs_real_tokens_per_s=[r["real_tokens_per_s"] for r in mine]))
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
    runs: list[list[dict]] = []
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(args.repeats):
            order = MODES if repeat % 2 == 0 else MODES[::-1]
            runs.append([run(mode, pairs, batch=args.batch, max_length=args.max_length, budget=budget,
                             workdir=workdir) for mode in order])
            print(f"repeat {repeat}: " + ", ".join(f"{r['mode']} {r['real_tokens_per_s']:.0f} tok/s"
                                                   for r in runs[-1]), flush=True)
    results = summarize(runs)
    report = dict(pairs=args.pairs, pairs_kept=len(kept), batch=args.batch, max_length=args.max_length,
                  token_budget=budget, threads=args.threads, repeats=args.repeats,
                  model="pf-trl/tiny-llama config as LlamaForSequenceClassification (4 x 256, vocab 32000, fp32, sdpa)",
                  torch=torch.__version__, results=results)
    print(f"\n{len(kept)} ShareGPT pairs (of {args.pairs}; TRL drops sequences over max_length {args.max_length}), "
          f"{args.batch} pairs a step (budget {budget} tokens), fp32, CPU {args.threads} thread(s), {args.repeats} "
          "interleaved repeats (median run; speedup: median of the per-repeat ratios, min-max)\n")
    print("| mode | steps | real tokens | processed | padding | real tok/s | vs TRL | peak RSS MB | vs TRL |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['steps']} | {r['real_tokens']} | {r['processed_tokens']} | {r['padding_share']:.1%} "
              f"| {r['real_tokens_per_s']:.0f} | {r['speedup_vs_trl']:.2f}x ({r['speedup_min']:.2f}-"
              f"{r['speedup_max']:.2f}) | {r['peak_rss_mb']:.0f} | {r['peak_rss_vs_trl']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
