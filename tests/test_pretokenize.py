"""pretokenize -> load_shards round trips for every input format, masking, policies and bad inputs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets
import numpy as np
import pytest

from pf_trl.data.pretokenize import PretokenizeConfig, PretokenizeError, pretokenize
from pf_trl.data.shards import MANIFEST_FILE, ShardsError, load_shards

from conftest import write_jsonl

TEMPLATE = "### Response:"

ROWS = [
    {"instruction": "Name a colour.", "response": "Blue is a colour."},
    {"instruction": "Add 2 and 3.", "response": "2 plus 3 is 5."},
    {"instruction": "Say hi in French.", "response": "Bonjour!"},
]


def as_text(row):
    return f"### Instruction:\n{row['instruction']}\n\n{TEMPLATE}\n{row['response']}"


def supervised_text(tok, example) -> str:
    return tok.decode([t for t in example["labels"] if t != -100])


def run(tmp_path, source, config=None, **kw):
    out = tmp_path / "out"
    manifest = pretokenize(source, out, config or PretokenizeConfig(), progress=False, **kw)
    return manifest, load_shards(out)


def assert_nothing_written(tmp_path):
    """No output and no temporary leftovers beside it."""
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out") or p.name == "out"]
    assert leftovers == []


def test_prompt_completion_masks_prompt(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": as_text(r).split(TEMPLATE)[0] + TEMPLATE + "\n",
                                               "completion": r["response"]} for r in ROWS])
    manifest, ds = run(tmp_path, src)
    assert manifest["source"]["input_format"] == "prompt_completion"
    for row, ex in zip(ROWS, ds):
        assert ex["input_ids"][0] == tokenizer.bos_token_id
        assert ex["input_ids"][-1] == tokenizer.eos_token_id
        assert supervised_text(tokenizer, ex).strip() == row["response"] + "</s>"
        assert ex["length"] == len(ex["input_ids"]) == len(ex["labels"])


def test_text_with_response_template_csv(tmp_path, tokenizer):
    src = tmp_path / "t.csv"
    datasets.Dataset.from_list([{"output": as_text(r)} for r in ROWS]).to_csv(str(src))
    cfg = PretokenizeConfig(input_format="text", text_field="output", response_template=TEMPLATE, add_eos=False)
    manifest, ds = run(tmp_path, src, cfg)
    for row, ex in zip(ROWS, ds):
        assert supervised_text(tokenizer, ex).strip() == row["response"]
    assert manifest["counts"]["loss_tokens"] == sum(sum(t != -100 for t in ex["labels"]) for ex in ds)


def test_text_uses_last_template_occurrence(tmp_path, tokenizer):
    text = f"{TEMPLATE} quoted\n### Instruction:\nQ\n\n{TEMPLATE}\nfinal answer"
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": text}])
    _, ds = run(tmp_path, src, PretokenizeConfig(response_template=TEMPLATE, add_eos=False))
    assert supervised_text(tokenizer, ds[0]).strip() == "final answer"


def test_pretokenized_json_array_parquet_and_directory(tmp_path, tokenizer):
    rows = [{"input_ids": [1, 100, 200, 300, 2], "labels": [-100, -100, 200, 300, 2]},
            {"input_ids": [1, 5, 6], "labels": [-100, 5, 6]}]
    src = tmp_path / "pre.json"
    src.write_text(json.dumps(rows))  # the seed's JSON-array shape
    _, ds = run(tmp_path, src)
    assert ds[0]["input_ids"] == rows[0]["input_ids"] and ds[0]["labels"] == rows[0]["labels"]
    pq = tmp_path / "pre.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(pq))
    out2 = tmp_path / "out2"
    pretokenize(pq, out2, progress=False)
    assert load_shards(out2)[1]["labels"] == [-100, 5, 6]
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"input_ids": r["input_ids"]} for r in rows]).save_to_disk(str(saved))
    out3 = tmp_path / "out3"
    pretokenize(saved, out3, progress=False)
    assert load_shards(out3)[1]["labels"] == [1, 5, 6]  # no labels column: every token supervised


def test_messages_supervise_assistant_turns_only(tmp_path, tokenizer):
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
    src = write_jsonl(tmp_path / "m.jsonl", [{"messages": chat}])
    manifest, ds = run(tmp_path, src)
    assert manifest["source"]["input_format"] == "messages"
    ids, labels = ds[0]["input_ids"], ds[0]["labels"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    spans, cur = [], []
    for t, lab in zip(ids, labels):
        if lab != -100:
            cur.append(t)
        elif cur:
            spans.append(tokenizer.decode(cur).strip())
            cur = []
    if cur:
        spans.append(tokenizer.decode(cur).strip())
    assert spans == ["Hello!</s>", "Paris.</s>"]


def test_truncation_policies(tmp_path, tokenizer):
    long_row = {"prompt": "Q: ", "completion": "word " * 200}
    src = write_jsonl(tmp_path / "long.jsonl", [long_row, {"prompt": "Q: ", "completion": "short"}])
    m, ds = run(tmp_path, src, PretokenizeConfig(max_seq_len=64, truncation="truncate"))
    assert m["counts"]["truncated"] == 1 and max(ds["length"]) == 64
    m2 = pretokenize(src, tmp_path / "drop", PretokenizeConfig(max_seq_len=64, truncation="drop"), progress=False)
    assert m2["counts"]["examples"] == 1 and m2["counts"]["dropped_too_long"] == 1
    for policy in ("refuse", "error"):  # `error`: the older name of `refuse`
        with pytest.raises(PretokenizeError, match=r"1 of 2 examples are longer than max_seq_len 64 \(first: row 0, "
                                                   r"\d+ tokens\) and the truncation policy is 'refuse'"):
            pretokenize(src, tmp_path / "err", PretokenizeConfig(max_seq_len=64, truncation=policy), progress=False)
        assert not (tmp_path / "err").exists()


def test_manifest_contents_on_shipped_sample(sample_shards):
    ds = load_shards(sample_shards)
    m = ds.pf_manifest
    c = m["counts"]
    assert c["source_rows"] == 2500 and c["examples"] == ds.num_rows == 2500 - c["dropped"]
    assert c["tokens"] == int(np.sum(ds["length"]))
    assert m["tokenizer"]["vocab_size"] == 32000 and m["tokenizer"]["eos_token_id"] == 2
    assert len(m["tokenizer"]["sha256"]) == 64 and len(m["source"]["sha256"]) == 64
    s = m["lengths"]
    assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"] <= 1024
    assert sum(s["histogram"]["counts"]) == ds.num_rows
    assert m["max_seq_len"] == 1024 and m["truncation"] == "truncate"
    # memory-mapped, not loaded into RAM
    assert all(f["filename"].endswith(".arrow") for f in ds.cache_files)
    # plain datasets can open it too
    assert datasets.load_from_disk(str(sample_shards)).num_rows == ds.num_rows


def test_existing_output_is_never_touched(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "completion": "b"}])
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(PretokenizeError, match="already exists"):
        pretokenize(src, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"


@pytest.mark.slow
def test_overwrite_replaces_atomically(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "completion": "b"}])
    out = tmp_path / "out"
    pretokenize(src, out, progress=False)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}])
    with pytest.raises(PretokenizeError):
        pretokenize(bad, out, overwrite=True, progress=False)
    assert load_shards(out).num_rows == 1  # the old output survived the failed overwrite
    pretokenize(write_jsonl(tmp_path / "b.jsonl", [{"prompt": "a", "completion": "b"}] * 2), out,
                overwrite=True, progress=False)
    assert load_shards(out).num_rows == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _malformed_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "c", "completion": "d"}\n{"prompt": "e", "compl\n')
    return p, PretokenizeConfig()


BAD_INPUTS = {
    "missing column": (lambda t: (write_jsonl(t / "x.jsonl", [{"prompt": "a"}]),
                                  PretokenizeConfig(input_format="prompt_completion")), "needs column"),
    "malformed json line": (_malformed_line, "line 3"),
    "empty file": (lambda t: (_write(t / "e.jsonl", ""), PretokenizeConfig()), "empty"),
    "wrong types": (lambda t: (write_jsonl(t / "w.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": 3, "completion": "b"}]),
                               PretokenizeConfig()), "row 1: column 'prompt' must be a string"),
    "template never found": (lambda t: (write_jsonl(t / "n.jsonl", [{"text": "no template here"}]),
                                        PretokenizeConfig(response_template=TEMPLATE)), "row 0: response template"),
    "nonexistent source": (lambda t: (t / "nope.jsonl", PretokenizeConfig()), "does not exist"),
    "unsupported suffix": (lambda t: (_write(t / "d.txt", "x"), PretokenizeConfig()), "suffix"),
    "no detectable format": (lambda t: (write_jsonl(t / "f.jsonl", [{"foo": 1}]), PretokenizeConfig()), "cannot detect"),
    "token id outside vocab": (lambda t: (write_jsonl(t / "v.jsonl", [{"input_ids": [1, 99999]}]), PretokenizeConfig()),
                               "outside the tokenizer's vocabulary"),
    "labels length mismatch": (lambda t: (write_jsonl(t / "l.jsonl", [{"input_ids": [1, 2], "labels": [1]}]),
                                          PretokenizeConfig()), "as long as"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_inputs_give_clear_errors_and_write_nothing(tmp_path, case):
    make, message = BAD_INPUTS[case]
    src, cfg = make(tmp_path)
    with pytest.raises(PretokenizeError, match=message):
        pretokenize(src, tmp_path / "out", cfg, progress=False)
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_seq_len": 0}, "positive"), ({"truncation": "chop"}, "unknown"), ({"input_format": "xml"}, "unknown"),
    ({"input_format": "text"}, "response_template"),
])
def test_bad_config(kwargs, message):
    with pytest.raises(PretokenizeError, match=message):
        PretokenizeConfig(**kwargs)


def test_num_proc_gives_identical_shards(tmp_path, sample_rows):
    src = write_jsonl(tmp_path / "s.jsonl", sample_rows[:300])
    pretokenize(src, tmp_path / "one", progress=False)
    pretokenize(src, tmp_path / "two", num_proc=2, progress=False)
    a, b = load_shards(tmp_path / "one"), load_shards(tmp_path / "two")
    assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"]


def test_progress_callback_reports_rows_and_tokens(tmp_path, sample_rows):
    src = write_jsonl(tmp_path / "s.jsonl", sample_rows[:50])
    calls = []
    m = pretokenize(src, tmp_path / "o", progress=False, progress_callback=lambda *a: calls.append(a))
    assert calls[-1][0] == calls[-1][1] == 50
    assert calls[-1][2] >= m["counts"]["tokens"]


# ---------------------------------------------------------------------------------- load_shards


def test_load_shards_errors(tmp_path, sample_shards, tokenizer):
    with pytest.raises(ShardsError, match="does not exist"):
        load_shards(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ShardsError, match="no pf_manifest.json"):
        load_shards(empty)
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(sample_shards, copy)
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    (copy / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ShardsError, match="corrupt"):
        load_shards(copy)
    (copy / MANIFEST_FILE).write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(ShardsError, match="version 99"):
        load_shards(copy)
    (copy / MANIFEST_FILE).write_text(json.dumps({**manifest, "counts": {**manifest["counts"], "examples": 3}}))
    with pytest.raises(ShardsError, match="modified"):
        load_shards(copy)
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    other = {**manifest["tokenizer"], "sha256": "0" * 64, "name": "other"}
    with pytest.raises(ShardsError, match="re-run pretokenize with the model's tokenizer"):
        load_shards(copy, expected_tokenizer=other)
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    assert load_shards(copy, expected_tokenizer=tokenizer_fingerprint(tokenizer)).num_rows > 0
    for arrow in copy.glob("*.arrow"):
        os.truncate(arrow, 100)
    with pytest.raises(ShardsError, match="has 100 bytes, the manifest says"):  # the checksums see it first
        load_shards(copy)
    with pytest.raises(ShardsError, match="cannot be opened"):
        load_shards(copy, verify=False)


def test_cli_pretokenize(tmp_path, capsys):
    from pf_trl.cli.main import main

    src = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "completion": "b"}])
    assert main(["pretokenize", str(src), str(tmp_path / "out"), "--max_seq_len", "32", "--no_progress"]) == 0
    assert json.loads(capsys.readouterr().out)["counts"]["examples"] == 1
    assert main(["pretokenize", str(src), str(tmp_path / "out"), "--no_progress"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "out")]) == 0
