"""TRL's tokenized formats: `completion_mask` and `assistant_masks` become labels before columns are dropped.

Before: the trainer cut rows down to input_ids/labels first, so 12 rows with 192 completion tokens trained on all
511 tokens (prompts included)."""

from __future__ import annotations

import random

import datasets
import pytest

from conftest import write_jsonl

ROWS, COMPLETION = 12, 16
PROMPT_LENGTHS = [20, 31, 25, 22, 27, 30, 21, 26, 24, 29, 23, 41]  # 319 prompt + 192 completion = 511 tokens


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))


def trl_rows(mask_column: str, *, with_labels: bool = False) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for n in PROMPT_LENGTHS:
        ids = [1] + [rng.randrange(3, 32000) for _ in range(n - 1 + COMPLETION)]
        row = {"input_ids": ids, mask_column: [0] * n + [1] * COMPLETION}
        if with_labels:  # labels that also mask the first 2 completion tokens: the intersection keeps 14 per row
            row["labels"] = [-100] * (n + 2) + ids[n + 2:]
        rows.append(row)
    return rows


def trainer_for(rows, tmp_path, tokenizer, **config):
    """The trainer on ``rows``, given the session's tokenizer (the one it would load itself: the model's default) so
    that each of this module's seven trainers does not parse the 32,000-token vocabulary again."""
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    model = build_model("pf-trl/tiny-llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                        num_attention_heads=2, num_key_value_heads=1)
    args = PaddingFreeConfig(output_dir=str(tmp_path / "o"), report_to="none", max_steps=1, save_strategy="no",
                             **config)
    return PaddingFreeSFTTrainer(model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                 processing_class=tokenizer)


def trained_tokens(trainer) -> tuple[int, int, list[int]]:
    """(supervised labels, all tokens, supervised ids) over one epoch of the train dataloader (what the loss sees)."""
    supervised, total, ids = 0, 0, []
    for batch in trainer.get_train_dataloader():
        mask = batch["labels"] != -100
        supervised += int(mask.sum())
        total += int(batch["input_ids"].numel())
        ids += batch["input_ids"][mask].tolist()
    return supervised, total, ids


@pytest.mark.parametrize("column", ["completion_mask", "assistant_masks"])
def test_mask_column_becomes_labels(column, tmp_path, tokenizer):
    rows = trl_rows(column)
    assert sum(len(r["input_ids"]) for r in rows) == 511 and sum(sum(r[column]) for r in rows) == 192
    supervised, total, ids = trained_tokens(trainer_for(rows, tmp_path, tokenizer))
    assert (supervised, total) == (192, 511)
    expected = sorted(t for r in rows for t, bit in zip(r["input_ids"], r[column]) if bit)
    assert sorted(ids) == expected  # exactly the completion tokens (batches are shuffled: compare as multisets)


def test_negative_control_without_folding_every_token_trains(tmp_path, monkeypatch, tokenizer):
    """What happened before: the mask column is dropped with the other columns, and all 511 tokens train."""
    import pf_trl.data.sources as sources

    monkeypatch.setattr(sources, "fold_mask_columns", lambda dataset, **_: dataset)
    supervised, total, _ = trained_tokens(trainer_for(trl_rows("completion_mask"), tmp_path, tokenizer))
    # every token but each row's first (it has no previous token to be predicted from)
    assert (supervised, total) == (511 - ROWS, 511)


def test_labels_and_mask_intersect(tmp_path, tokenizer):
    supervised, _, _ = trained_tokens(trainer_for(trl_rows("completion_mask", with_labels=True), tmp_path, tokenizer))
    assert supervised == ROWS * (COMPLETION - 2)


def test_completion_only_loss_false_ignores_completion_mask_as_trl_does(tmp_path, tokenizer):
    supervised, total, _ = trained_tokens(trainer_for(trl_rows("completion_mask"), tmp_path, tokenizer,
                                                      completion_only_loss=False))
    assert (supervised, total) == (511 - ROWS, 511)
    supervised, _, _ = trained_tokens(trainer_for(trl_rows("assistant_masks"), tmp_path, tokenizer,
                                                  completion_only_loss=False))
    assert supervised == 192  # assistant_masks always applies (TRL likewise)


def test_cli_file_with_mask_column_gives_the_same_labels(tmp_path):
    from pf_trl.cli.train import build, parse_args

    src = write_jsonl(tmp_path / "trl.jsonl", trl_rows("completion_mask"))
    trainer = build(*parse_args(["--training_data_path", str(src), "--output_dir", str(tmp_path / "o"),
                                 "--model_overrides", "num_hidden_layers=1,hidden_size=32,intermediate_size=64,"
                                 "num_attention_heads=2,num_key_value_heads=1", "--report_to", "none"]), quiet=True)
    assert trainer.train_dataset.pf_manifest["counts"]["loss_tokens"] == 192
    supervised, total, _ = trained_tokens(trainer)
    assert (supervised, total) == (192, 511)


@pytest.mark.slow
def test_training_step_runs_on_folded_masks(tmp_path, tokenizer):
    trainer = trainer_for(trl_rows("assistant_masks"), tmp_path, tokenizer)
    result = trainer.train()
    assert result.metrics["train_loss"] > 0
