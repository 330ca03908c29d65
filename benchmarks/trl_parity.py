"""Which data is trained: PaddingFreeSFTTrainer against TRL's padded SFTTrainer, field by field (issue 19's table).

Usage: python benchmarks/trl_parity.py [--out benchmarks/results/trl_parity.json]  (~1 min on 2 CPU cores)

Each case builds TRL's stock ``SFTTrainer`` (padded, ``padding_free=False``) and pf-trl's trainer from the same
config fields and data, walks one epoch of each train (or eval) dataloader and counts what reaches the loss:
examples, tokens and supervised tokens (shifted labels). A case pf-trl refuses prints the first words of the refusal.
Printed as a markdown table; the JSON holds the same rows.
"""

from __future__ import annotations

from offline import REPO  # noqa: F401  (before any HF import: offline hub, the checkout's import path)

# isort: split

import argparse
import contextlib
import io
import json
import logging
import warnings
from pathlib import Path

import datasets
import torch
from trl_parity_support import fields, model, pf_trainer, trl_trainer
from trl_parity_support import rows as token_rows

warnings.filterwarnings("ignore")
logging.disable(logging.INFO)


class _Said(logging.Handler):
    """pf-trl's warnings while a trainer is built (a decision the user is told about)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


SAID = _Said()
logging.getLogger("pf_trl").addHandler(SAID)
logging.getLogger("pf_trl").propagate = False
datasets.disable_progress_bars()
torch.set_num_threads(2)

def walk(loader) -> dict:
    """Examples, tokens and supervised (shifted) labels one epoch of ``loader`` feeds the loss."""
    examples = tokens = supervised = 0
    order = []
    for batch in loader:
        labels = batch["labels"]
        if "position_ids" in batch and labels.shape[0] == 1 and "attention_mask" not in batch:  # packed row
            pos = batch["position_ids"].reshape(-1)
            starts = (pos == 0).nonzero().reshape(-1).tolist()
            examples += len(starts)
            tokens += int(labels.numel())
            order += [int(batch["input_ids"].reshape(-1)[s + 1]) for s in starts]
        else:
            mask = batch.get("attention_mask", torch.ones_like(labels))
            examples += int(labels.shape[0])
            tokens += int(mask.sum())
            order += [int(r[1]) for r in batch["input_ids"]]
        supervised += int((labels[..., 1:] != -100).sum())
    return {"examples": examples, "tokens": tokens, "supervised": supervised, "order": order}


def walk_said(trainer, loader) -> dict:
    seen = walk(loader)
    if getattr(trainer, "_said", None):
        seen["said"] = trainer._said
    return seen


def attempt(build):
    import contextlib
    import io

    SAID.lines.clear()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # Trainer's log dicts
            trainer = build()
        trainer._said = list(SAID.lines)
        return trainer, None
    except Exception as exc:  # a refusal is a result here
        return None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:150]}"


def case_truncation_40(tmp):
    rows = token_rows([64, 90, 70, 66, 81, 70], [10] * 6)  # 441 tokens, max_length 40
    out = {}
    for name, make in (("trl", trl_trainer), ("pf", pf_trainer)):
        kw = dict(max_length=40, per_device_train_batch_size=6, max_steps=1, learning_rate=1e-2)
        if name == "pf":
            kw["max_tokens_per_batch"] = 600  # one batch, as TRL's batch of 6: the step sees the same examples
        tr, err = attempt(lambda: make(rows, tmp / name, **kw))
        if err:
            out[name] = err
            continue
        out[name] = walk_said(tr, tr.get_train_dataloader())
        with contextlib.redirect_stdout(io.StringIO()):
            tr.train()
        out[name + "_params"] = [p.detach().clone() for p in tr.model.parameters()]
    if "trl_params" in out and "pf_params" in out:
        num = sum(float((a - b).pow(2).sum()) for a, b in zip(out["trl_params"], out["pf_params"]))
        den = sum(float((a - p0).pow(2).sum()) for a, p0 in zip(out["trl_params"], model().parameters()))
        out["param_update_rel_diff"] = (num / den) ** 0.5
    out.pop("trl_params", None)
    out.pop("pf_params", None)
    return out


def case_truncation_default(tmp):
    rows = token_rows([1300, 200, 50], [5] * 3)
    out = {}
    for name, make in (("trl", trl_trainer), ("pf", pf_trainer)):
        tr, err = attempt(lambda: make(rows, tmp / name, per_device_train_batch_size=3))
        out[name] = err or walk_said(tr, tr.get_train_dataloader())
        if not err:
            out[name]["lengths"] = sorted(len(r) for r in tr.train_dataset["input_ids"])
    return out


def case_eval_truncation(tmp):
    rows = token_rows([64, 90, 70, 66, 81, 70], [10] * 6)
    evals = token_rows([80, 100, 77, 96], [4] * 4, seed=1)
    out = {}
    for name, make in (("trl", trl_trainer), ("pf", pf_trainer)):
        tr, err = attempt(lambda: make(rows, tmp / name, eval_rows=evals, max_length=40, per_device_eval_batch_size=4))
        out[name] = err or walk_said(tr, tr.get_eval_dataloader())
    return out


def case_completion_mask_unset(tmp):
    rows = token_rows([30, 40, 50, 43], [15, 20, 25, 21], mask_column="completion_mask", labels=False)
    out = {}
    for name, make in (("trl", trl_trainer), ("pf", pf_trainer)):
        tr, err = attempt(lambda: make(rows, tmp / name, per_device_train_batch_size=4))
        out[name] = err or walk_said(tr, tr.get_train_dataloader())
    return out


def case_drop_last(tmp):
    rows = token_rows([20 + (i * 7) % 30 for i in range(23)], [0] * 23)
    out = {}
    for name, make in (("trl", trl_trainer), ("pf", pf_trainer)):
        tr, err = attempt(lambda: make(rows, tmp / name, dataloader_drop_last=True, per_device_train_batch_size=4))
        out[name] = err or walk_said(tr, tr.get_train_dataloader())
    return out


def case_sampling(strategy):
    def run(tmp):
        rows = token_rows([20 + (i * 7) % 30 for i in range(16)], [0] * 16)
        for i, r in enumerate(rows):  # token 1 of each example is its index: the order is readable from the batches
            r["input_ids"][1] = r["labels"][1] = 3 + i
        out = {}
        for name, make in (("trl", trl_trainer), ("pf", pf_trainer)):
            tr, err = attempt(lambda: make(rows, tmp / name, train_sampling_strategy=strategy,
                                           per_device_train_batch_size=4))
            if err:
                out[name] = err
                continue
            seen = walk_said(tr, tr.get_train_dataloader())
            order = [t - 3 for t in seen.pop("order")]
            seen["dataset_order"] = order == sorted(order)
            out[name] = seen
        return out

    return run


def case_resume_same_lengths(tmp):
    rows = token_rows([24] * 16, [0] * 16)
    other = list(reversed(rows))  # the same lengths in the same positions, other examples
    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    def make(data, out):
        args = PaddingFreeConfig(**fields(out, padding_free_mode="huggingface", max_steps=3, save_strategy="steps",
                                         save_steps=2, per_device_train_batch_size=4))
        return PaddingFreeSFTTrainer(model(), args=args, train_dataset=datasets.Dataset.from_list(data),
                                     processing_class=load_tokenizer())

    with contextlib.redirect_stdout(io.StringIO()):
        make(rows, tmp / "a").train()
    tr = make(other, tmp / "b")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            tr.train(resume_from_checkpoint=str(tmp / "a" / "checkpoint-2"))
        return {"pf": "accepted", "trl": "(no check)"}
    except ValueError as exc:
        return {"pf": f"refused: {' '.join(str(exc).split())[:150]}", "trl": "(no check)"}


CASES = {
    "pre-tokenized rows (64-90 tokens), max_length 40": case_truncation_40,
    "default max_length 1024, rows of 1300/200/50": case_truncation_default,
    "eval rows longer than max_length 40": case_eval_truncation,
    "completion_mask, completion_only_loss unset": case_completion_mask_unset,
    "dataloader_drop_last=True (23 examples, batch 4)": case_drop_last,
    "train_sampling_strategy=sequential": case_sampling("sequential"),
    "train_sampling_strategy=group_by_length": case_sampling("group_by_length"),
    "resume on other data with the same lengths": case_resume_same_lengths,
}


def _cell(value) -> str:
    if isinstance(value, dict):
        keep = {k: v for k, v in value.items() if k not in ("order", "said")}
        text = ", ".join(f"{k} {v}" for k, v in keep.items())
        if value.get("said"):
            text += "; said: " + " / ".join(line[:110] + "..." for line in value["said"])
        return text
    return str(value)


def main(argv=None) -> int:
    import tempfile

    import pf_trl

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, case) in enumerate(CASES.items()):
            row = case(Path(tmp) / f"case{i}")
            for side in ("trl", "pf"):
                if isinstance(row.get(side), dict):
                    row[side].pop("order", None)
            results[name] = row
    print("| case | pf-trl | TRL 1.16 (padded) |")
    print("|---|---|---|")
    for name, row in results.items():
        extra = f" (params after one step: {row['param_update_rel_diff']:.3g} relative)" if "param_update_rel_diff" in row else ""
        print(f"| {name} | {_cell(row['pf'])}{extra} | {_cell(row['trl'])} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"code": pf_trl.__file__, "rows": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
