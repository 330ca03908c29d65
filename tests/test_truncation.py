"""The sequence limit as TRL applies it (keep_start / keep_end, rows left without loss dropped), the truncation policy
(truncate | drop | refuse) and the count the user sees: in truncate_dataset, pretokenize, the manifest and both CLIs.

Before (issue 23): `--max_seq_len 512` on data with 761-token examples cut 48 of 270 in silence (exit 0, a
`"truncated": 48` in pretokenize's JSON only)."""

from __future__ import annotations

import json
import random

import datasets
import numpy as np
import pytest

from pf_trl.data.truncation import TruncationRefused, cut, truncate_dataset

from conftest import write_jsonl


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))


def random_rows(n=200, seed=0, *, with_labels=True):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = rng.choice([1, 2, 5, 39, 40, 41, 64, 130])
        ids = [rng.randrange(3, 500) for _ in range(length)]
        row = {"input_ids": ids, "length": length}
        if with_labels:
            style = rng.random()
            if style < 0.2:
                labels = [-100] * length  # no supervised token at all
            elif style < 0.6:
                prompt = rng.randrange(0, length + 1)
                labels = [-100] * prompt + ids[prompt:]
            else:
                labels = [t if rng.random() < 0.5 else -100 for t in ids]
            row["labels"] = labels
        rows.append(row)
    return rows


def reference(rows, max_length, mode):
    """TRL's _prepare_dataset in plain Python: cut, then drop rows without a label other than -100."""
    out, lost, cut_rows = [], 0, 0
    for row in rows:
        labels = row.get("labels", row["input_ids"])
        ids, kept = cut(row["input_ids"], labels, max_length, mode)
        if len(ids) < len(row["input_ids"]):
            cut_rows += 1
            lost += sum(t != -100 for t in labels) - sum(t != -100 for t in kept)
        if any(t != -100 for t in kept):
            out.append((ids, kept))
    return out, lost, cut_rows


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
@pytest.mark.parametrize("with_labels", [True, False])
def test_truncate_dataset_equals_trls_rule(mode, with_labels):
    rows = random_rows(with_labels=with_labels)
    ds = datasets.Dataset.from_list(rows)
    out, report = truncate_dataset(ds, max_length=40, mode=mode, batch_rows=37)  # several Arrow batches
    expected, lost, cut_rows = reference(rows, 40, mode)
    got = [(r["input_ids"], r.get("labels", r["input_ids"])) for r in out]
    assert got == expected
    assert out["length"] == [len(ids) for ids, _ in expected]  # the sampler's column follows the cut
    assert (report.truncated, report.loss_tokens_lost) == (cut_rows, lost)
    assert report.dropped_no_loss == len(rows) - len(expected) and report.kept == len(expected)


def test_nothing_to_do_returns_the_same_dataset_and_none_means_no_limit():
    ds = datasets.Dataset.from_list([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}])
    assert truncate_dataset(ds, max_length=8)[0] is ds
    long = datasets.Dataset.from_list([{"input_ids": list(range(50)), "labels": [-100] * 50}])
    out, report = truncate_dataset(long, max_length=None)
    assert out is long and report.truncated == 0 and report.dropped_no_loss == 0  # TRL: None cuts and drops nothing


def test_drop_and_refuse_policies_count_what_they_would_cut():
    rows = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (10, 50, 60, 20)]
    ds = datasets.Dataset.from_list(rows)
    out, report = truncate_dataset(ds, max_length=40, policy="drop")
    assert [len(r) for r in out["input_ids"]] == [10, 20]
    assert (report.dropped_too_long, report.loss_tokens_lost, report.truncated) == (2, 110, 0)
    assert report.summary() == ("training data: 2 of 4 examples longer than max_length 40 were dropped (truncation "
                                "policy 'drop'); 110 supervised tokens lost; raise max_length or choose the "
                                "truncation policy (truncate | drop | refuse)")
    with pytest.raises(TruncationRefused, match=r"^2 of 4 examples are longer than max_length 40 \(first: row 1, 50 "
                                                r"tokens\) and the truncation policy is 'refuse'"):
        truncate_dataset(ds, max_length=40, policy="refuse")


@pytest.mark.slow
def test_pretokenize_keep_end_and_manifest_counts(tmp_path):
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize
    from pf_trl.data.shards import load_shards

    rows = [{"input_ids": [1] + list(range(10, 10 + n - 1)), "labels": [-100] * 30 + list(range(10 + 29, 10 + n - 1))}
            for n in (60, 35, 80)]
    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    config = PretokenizeConfig(max_seq_len=40, truncation_mode="keep_end")
    manifest = pretokenize(src, tmp_path / "out", config, progress=False)
    ds = load_shards(tmp_path / "out")
    assert [r[-40:] for r in (rows[0]["input_ids"], rows[2]["input_ids"])] == [ds[0]["input_ids"], ds[2]["input_ids"]]
    counts = manifest["counts"]
    assert (counts["truncated"], counts["loss_tokens_lost"]) == (2, 10)  # 80 tokens: 50 supervised, the last 40 kept
    assert manifest["options"]["truncation_mode"] == "keep_end"
    start = pretokenize(src, tmp_path / "start", PretokenizeConfig(max_seq_len=40), progress=False)["counts"]
    assert (start["truncated"], start["loss_tokens_lost"]) == (2, 20 + 40)  # keep_start: 10 of 30 and 10 of 50 kept


@pytest.mark.slow
def test_cli_pretokenize_says_what_was_cut(tmp_path, capsys):
    from pf_trl.cli.pretokenize import main

    rows = [{"prompt": "Q: ", "completion": "word " * n} for n in (100, 5, 300)]
    src = write_jsonl(tmp_path / "pc.jsonl", rows)
    assert main([str(src), str(tmp_path / "out"), "--max_seq_len", "64", "--no_progress"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["counts"]["truncated"] == 2  # stdout stays JSON
    line = [x for x in err.splitlines() if "were cut" in x]
    assert len(line) == 1 and line[0].startswith("pf-trl pretokenize: examples: 2 of 3 examples were longer than "
                                                 "--max_seq_len 64 and were cut (keep_start); ")
    assert "supervised tokens lost" in line[0]
    assert main([str(src), str(tmp_path / "refused"), "--max_seq_len", "64", "--truncation", "refuse",
                 "--no_progress"]) == 2
    assert "2 of 3 examples are longer than max_seq_len 64" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_cli_help_states_the_policy_default(capsys):
    from pf_trl.cli.pretokenize import main

    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "'truncate' (default, as TRL" in text and "'refuse'" in text


def test_cli_train_says_what_was_cut_and_one_limit(tmp_path, capsys):
    from pf_trl.cli.train import TrainCLIError, build, parse_args

    rows = [{"prompt": "Q: ", "completion": "word " * n} for n in (100, 5, 300, 10)]
    src = write_jsonl(tmp_path / "pc.jsonl", rows)
    base = ["--training_data_path", str(src), "--output_dir", str(tmp_path / "o"), "--report_to", "none",
            "--model_overrides", "num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,"
            "num_key_value_heads=1"]
    trainer = build(*parse_args([*base, "--max_seq_len", "64"]))
    out = capsys.readouterr().out
    assert "pf-trl: training data: 2 of 4 examples were longer than --max_seq_len 64 and were cut (keep_start); " in out
    assert trainer.args.max_length == 64 and max(trainer.train_dataset["length"]) == 64
    _, data_args, config = parse_args([*base, "--max_length", "128"])  # TRL's name of the same limit
    assert (data_args.max_seq_len, config.max_length) == (128, 128)
    with pytest.raises(TrainCLIError, match="--max_seq_len 64 and --max_length 128 are the same limit"):
        parse_args([*base, "--max_seq_len", "64", "--max_length", "128"])


@pytest.mark.slow
def test_trainer_cuts_shards_without_writing_into_them(tmp_path, sample_shards):
    """Shards made with a longer limit are cut to max_length in a private copy: the shards directory is untouched."""
    from pf_trl.data.shards import load_shards
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    before = sorted(p.name for p in sample_shards.iterdir())
    shards = load_shards(sample_shards)
    assert max(shards["length"]) > 256
    args = PaddingFreeConfig(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[], max_length=256)
    trainer = PaddingFreeSFTTrainer("pf-trl/tiny-llama", args=args, train_dataset=shards)
    lengths = np.asarray(trainer.train_dataset["length"])
    assert lengths.max() == 256 and len(lengths) <= len(shards)
    assert sorted(p.name for p in sample_shards.iterdir()) == before


@pytest.mark.slow
def test_labels_of_another_length_are_refused_with_the_row():
    ds = datasets.Dataset.from_list([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]},
                                     {"input_ids": [1, 2, 3, 4], "labels": [-100, 2]}])
    with pytest.raises(ValueError, match=r"row 1: labels has 2 tokens but input_ids has 4"):
        truncate_dataset(ds, max_length=2)
