"""One identity check for every way shards arrive (a path, load_shards, load_from_disk, concatenated, selected), and
parts of different formats recorded per part or refused with the way out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_jsonl

TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
OTHER_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _rows(sample_rows, n=12):
    alpaca = [{"instruction": r["prompt"][15:200], "input": "", "output": r["completion"][:300]} for r in sample_rows[:n]]
    sharegpt = [{"conversations": [{"from": "human", "value": r["prompt"][15:200]},
                                   {"from": "gpt", "value": r["completion"][:300]}]} for r in sample_rows[n:2 * n]]
    return alpaca, sharegpt


@pytest.fixture(scope="module")
def shards(tmp_path_factory, sample_rows, tokenizer):
    """Good shards (the model's tokenizer) and shards of the same rows made with the same vocabulary but another chat
    template (another tokenizer identity)."""
    from pf_trl.data.pretokenize import pretokenize
    from pf_trl.data.tokenizer import load_tokenizer

    d = tmp_path_factory.mktemp("identity")
    _, sharegpt = _rows(sample_rows)
    write_jsonl(d / "chats.jsonl", sharegpt)
    pretokenize(d / "chats.jsonl", d / "good", tokenizer=tokenizer, progress=False)
    other = load_tokenizer()
    other.chat_template = OTHER_TEMPLATE
    pretokenize(d / "chats.jsonl", d / "other", tokenizer=other, progress=False)
    return d


def _trainer(train_dataset, tokenizer, tmp_path):
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    args = PaddingFreeConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_length=None,
                             max_steps=1, save_strategy="no")
    return PaddingFreeSFTTrainer(build_model("pf-trl/tiny-llama", seed=0, **TINY), args=args,
                                 train_dataset=train_dataset, processing_class=tokenizer)


@pytest.mark.parametrize("how", ["load_shards", "load_from_disk", "concatenated", "selected", "mapped", "streamed"])
def test_shards_of_another_tokenizer_refused_however_they_arrive(shards, tokenizer, tmp_path, how):
    import datasets

    from pf_trl.data.shards import load_shards

    good, other = datasets.load_from_disk(str(shards / "good")), datasets.load_from_disk(str(shards / "other"))
    given = {
        "load_shards": lambda: load_shards(shards / "other"),
        "load_from_disk": lambda: other,
        "concatenated": lambda: datasets.concatenate_datasets([good, other]),
        "selected": lambda: datasets.concatenate_datasets([good, other]).shuffle(seed=0).select(range(5)),
        "mapped": lambda: other.map(lambda r: {"labels": r["labels"]}).flatten_indices(),
        "streamed": lambda: other.to_iterable_dataset(),
    }[how]()
    assert other.features == good.features and max(max(r) for r in other["input_ids"]) < len(tokenizer)  # ids fit
    with pytest.raises(ValueError, match="was tokenized with another tokenizer than the model's: chat template differs"):
        _trainer(given, tokenizer, tmp_path)


@pytest.mark.parametrize("how", ["load_from_disk", "concatenated"])
def test_shards_of_the_models_tokenizer_accepted_as_a_dataset(shards, tokenizer, tmp_path, how):
    """The negative control: the same ways, the model's own tokenizer."""
    import datasets

    good = datasets.load_from_disk(str(shards / "good"))
    given = good if how == "load_from_disk" else datasets.concatenate_datasets([good, good])
    trainer = _trainer(given, tokenizer, tmp_path)
    assert trainer.train_dataset.num_rows == given.num_rows


def test_identity_travels_in_dataset_info(shards):
    import datasets

    from pf_trl.data.identity import identities

    other = datasets.load_from_disk(str(shards / "other"))
    in_memory = datasets.Dataset.from_dict(other.select(range(3)).to_dict())  # no Arrow files next to a manifest
    in_memory.info.description = other.info.description
    found = identities(in_memory)
    assert len(found) == 1 and found[0]["input_format"] == "sharegpt"
    bare = datasets.Dataset.from_dict(other.select(range(3)).to_dict())
    assert identities(bare) == []  # rows from elsewhere: no identity (their ids are range-checked instead)


def test_concatenated_rows_of_two_formats_refused_with_the_way_out(sample_rows, tokenizer, tmp_path):
    import datasets

    alpaca, sharegpt = _rows(sample_rows)
    mixed = datasets.concatenate_datasets([datasets.Dataset.from_list(alpaca), datasets.Dataset.from_list(sharegpt)])
    with pytest.raises(ValueError, match=r"the rows mix input formats: row 12 is 'sharegpt' but row 0 has no "
                                         r"'conversations' and reads as 'alpaca'.*list of sources"):
        _trainer(mixed, tokenizer, tmp_path)
    # the way out: the two as sources of a mixture, each tokenized with its own format
    write_jsonl(tmp_path / "a.jsonl", alpaca)
    write_jsonl(tmp_path / "s.jsonl", sharegpt)
    trainer = _trainer([(str(tmp_path / "a.jsonl"), 1), (str(tmp_path / "s.jsonl"), 1)], tokenizer, tmp_path)
    assert [s["input_format"] for s in trainer.train_dataset.pf_manifest["sources"]] == ["alpaca", "sharegpt"]


@pytest.mark.slow
def test_k8s_merge_records_each_parts_format(sample_rows, tokenizer, tmp_path):
    from pf_trl.data.pretokenize import pretokenize

    alpaca, sharegpt = _rows(sample_rows)
    parts = tmp_path / "parts"
    parts.mkdir()
    pretokenize(write_jsonl(tmp_path / "a.jsonl", alpaca), parts / "part-0", tokenizer=tokenizer, progress=False)
    pretokenize(write_jsonl(tmp_path / "s.jsonl", sharegpt), parts / "part-1", tokenizer=tokenizer, progress=False)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "k8s/scripts/merge_shards.py"), str(parts), str(tmp_path / "m")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "m" / "pf_manifest.json").read_text())
    assert manifest["source"]["input_format"] == "mixed"
    assert [(s["name"], s["input_format"], s["rows"]) for s in manifest["sources"]] == [
        ("part-0", "alpaca", [0, 12]), ("part-1", "sharegpt", [12, 24])]
    out = subprocess.run([sys.executable, "-m", "pf_trl.cli.main", "inspect", str(tmp_path / "m")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "source part-0: format alpaca, rows 0..11" in out.stdout
    assert "source part-1: format sharegpt, rows 12..23" in out.stdout
