"""KTO training speed: TRL's KTOTrainer (padded) against PaddingFreeKTOTrainer under the same KTOConfig.

Usage: python benchmarks/kto_throughput.py [--rows 8] [--batch 4] [--max_length 512] [--repeats 3]
                                           [--threads 1] [--out benchmarks/results/kto_throughput.json]

Unpaired rows of real, long-tailed lengths: the prompt and response of a ShareGPT first turn (the shipped sample,
``pf_trl/data/samples/sharegpt_sample.jsonl``, as the DPO and reward benchmarks read it) as ``prompt`` /
``completion``, desirable and undesirable alternating (``label``). The model is pf-trl's tiny Llama (4 layers x 256,
Mistral vocabulary 32,000, float32, sdpa) with a separate reference model; ``bf16=False``; TRL's ``kto`` loss, so
every step also runs the KL completions (the batch's completions rotated by one) through policy and reference. Every
mode trains one epoch over the same rows with the same ``KTOConfig`` fields:

- ``trl``: TRL's KTOTrainer, ``per_device_train_batch_size`` rows a step, completions and KL completions padded;
- ``trl-completions``: the same, with TRL's LM head scoring only the positions whose label is kept, as it does on
  Triton devices (CUDA) (:func:`preference_bench.compact_trl_head`). Against it, ``pf-fixed-trl-head`` is packing
  alone;
- ``pf-fixed``: PaddingFreeKTOTrainer, TRL's batches (the same rows and KL pairs in the same steps), each forward one
  packed row, pf-trl's CPU head on the completion tokens;
- ``pf-fixed-trl-head``: the same, with TRL's own LM-head kernel on the completion tokens instead of pf-trl's CPU head.

No token-budget mode: PaddingFreeKTOTrainer refuses budgets (they would regroup the rows whose KL TRL averages).
Real tokens are the completion batches' (prompt + completion) tokens, counted by the same code in every mode; each
step also runs the KL batch, so tokens/s compare the same work. The padding share of TRL's batches is reported for
the completions and for the KL completions (TRL's own collated batches, counted from their attention masks).
Prints a markdown table and writes the JSON.
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

MODES = ("trl", "trl-completions", "pf-fixed", "pf-fixed-trl-head")
_POLICY_FIELDS = ("log_probs", "entropy", "mean_logits")  # what TRL's KTOTrainer asks the policy's head for


def kto_rows(n: int) -> list[dict]:
    """``n`` unpaired rows (ShareGPT first turns), desirable and undesirable alternating."""
    return [dict(prompt=p["prompt"], completion=p["chosen"], label=i % 2 == 0) for i, p in enumerate(sharegpt_pairs(n))]


def _measured_trl_cls():
    from trl import KTOTrainer

    from pf_trl.trainer.accounting import TokenAccountingMixin

    class MeasuredKTOTrainer(TokenAccountingMixin, KTOTrainer):
        """Stock TRL KTOTrainer (padded) measured by the same code as pf-trl's."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._pf_init_metrics()

    return MeasuredKTOTrainer


def batch_padding(trainer) -> dict:
    """Padding share of TRL's collated batches (one epoch of its dataloader): completions and KL completions."""
    real = dict(completions=0, kl_completions=0)
    total = dict(real)
    for batch in trainer.get_train_dataloader():
        for key, mask in (("completions", "attention_mask"), ("kl_completions", "KL_attention_mask")):
            if mask in batch:
                real[key] += int(batch[mask].sum())
                total[key] += int(batch[mask].numel())
    real["both"], total["both"] = sum(real.values()), sum(total.values())
    return {f"padding_share_{key}": 1 - real[key] / total[key] for key in real if total[key]}


def run(mode: str, rows: list[dict], *, batch: int, max_length: int, workdir: str) -> dict:
    from trl import KTOConfig

    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.models import build_model
    from pf_trl.trainer.preference import PaddingFreeKTOTrainer
    from pf_trl.trainer.preference.self_packed_forward import install_self_packed_forward

    args = KTOConfig(output_dir=str(Path(workdir) / mode), report_to=[], save_strategy="no", use_cpu=True, seed=0,
                     per_device_train_batch_size=batch, num_train_epochs=1, max_length=max_length, logging_steps=1000,
                     disable_tqdm=True, learning_rate=1e-5, dataloader_num_workers=0, bf16=False)
    cls = _measured_trl_cls() if mode.startswith("trl") else PaddingFreeKTOTrainer
    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0)
    ref = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=1)
    trainer = cls(model, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(rows),
                  processing_class=load_tokenizer())
    if mode == "pf-fixed-trl-head":
        install_self_packed_forward(model, _POLICY_FIELDS, head="trl")
        install_self_packed_forward(ref, ("log_probs",), head="trl")
    with compact_trl_head(mode == "trl-completions"):
        metrics = trainer.train().metrics
    out = run_figures(mode, trainer, metrics)
    if mode == "trl":
        out.update(batch_padding(trainer))
    del trainer, model, ref
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)  # one thread: a shared machine's load skews more threads
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)} (trl "
                        "always runs)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "kto_throughput.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    modes = tuple(m for m in MODES if m == "trl" or m in args.modes.split(","))
    rows = kto_rows(args.rows)
    with tempfile.TemporaryDirectory() as workdir:
        runs = interleaved(modes, args.repeats, lambda mode: run(mode, rows, batch=args.batch,
                                                                 max_length=args.max_length, workdir=workdir))
    results = summarize(runs, modes)
    trl = next(r for r in results if r["mode"] == "trl")
    padding = {k: trl[k] for k in ("padding_share_completions", "padding_share_kl_completions",
                                   "padding_share_both")}
    # packing removes the padded tokens of both batches: the backbone's ceiling, with TRL's head already compact
    share = padding["padding_share_both"]
    report = dict(rows=args.rows, batch=args.batch, max_length=args.max_length, threads=args.threads,
                  repeats=args.repeats, loss_type="kto", precision="fp32",
                  model="pf-trl/tiny-llama (4 x 256, vocab 32000, fp32, sdpa), separate reference model",
                  torch=torch.__version__, **padding,
                  gpu_packing_ceiling=1 / (1 - share), results=results)
    print(f"\n{args.rows} ShareGPT rows (unpaired, labels alternating), {args.batch} a step, max_length "
          f"{args.max_length}, fp32, CPU {args.threads} thread(s), {args.repeats} interleaved repeats (median run; "
          "speedup: median of the per-repeat ratios, min-max)\n")
    print_table(results)
    print(f"\nTRL's padding: completions {padding['padding_share_completions']:.1%}, KL completions "
          f"{padding['padding_share_kl_completions']:.1%} (both {share:.1%}): packing alone is worth at most "
          f"{1 / (1 - share):.2f}x where TRL's head already scores only completions (CUDA)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
