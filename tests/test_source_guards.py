"""Sources read nothing outside themselves, rows are bounded before a reader parses them, and text far longer
than max_seq_len is cut before tokenizing with the same tokens and labels as tokenizing it whole."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from conftest import write_jsonl

SECRET = "OUTSIDE-SECRET-9931"


def _save(folder: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    return folder


def _point_state_at(folder: Path, filename: str) -> None:
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": filename}]
    (folder / "state.json").write_text(json.dumps(state))


@pytest.fixture()
def outside_arrow(tmp_path) -> Path:
    folder = _save(tmp_path / "outside" / "secret", [{"prompt": f"{SECRET} {i}\n", "completion": SECRET} for i in range(3)])
    return next(folder.glob("*.arrow"))


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_save_to_disk_naming_a_file_outside_is_refused_before_reading(tmp_path, outside_arrow, how, tokenizer):
    from pf_trl.data.pretokenize import PretokenizeError, pretokenize, source_fingerprint

    root = tmp_path / "root"
    evil = _save(root / "evil", [{"prompt": "q\n", "completion": "a"}] * 3)
    name = os.path.relpath(outside_arrow, evil) if how == "relative" else str(outside_arrow)
    _point_state_at(evil, name)
    os.chmod(outside_arrow, 0o000) if os.geteuid() else None  # (as root the mode does not stop a read)
    with pytest.raises(PretokenizeError, match=r"names the data file .* which lies outside the folder") as info:
        pretokenize(evil, tmp_path / "out", tokenizer=tokenizer, progress=False)
    assert SECRET not in str(info.value) and str(outside_arrow.stat().st_size) not in str(info.value)
    with pytest.raises(PretokenizeError, match="outside the folder"):
        source_fingerprint(evil)  # the content address covers the data files, so it refuses the same folder
    assert not (tmp_path / "out").exists()
    # Negative control: the same folder with its data file inside loads, and its hash covers that file.
    os.chmod(outside_arrow, 0o644)
    good = root / "good"
    good.mkdir()
    (good / outside_arrow.name).write_bytes(outside_arrow.read_bytes())
    for f in ("state.json", "dataset_info.json"):
        (good / f).write_bytes((evil / f).read_bytes())
    _point_state_at(good, outside_arrow.name)
    first = source_fingerprint(good)
    manifest = pretokenize(good, tmp_path / "out", tokenizer=tokenizer, progress=False)
    assert manifest["counts"]["examples"] == 3
    data = bytearray(outside_arrow.read_bytes())
    data[len(data) // 2] ^= 0xFF
    (good / outside_arrow.name).write_bytes(bytes(data))
    assert source_fingerprint(good) != first


def test_dataset_dict_split_outside_is_refused(tmp_path):
    import datasets

    from pf_trl.data.source_files import SourceFileError, save_to_disk_files

    d = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "x"}])}).save_to_disk(str(d))
    assert any(p.name.endswith(".arrow") for p in save_to_disk_files(d))
    (d / "dataset_dict.json").write_text(json.dumps({"splits": ["../../elsewhere"]}))
    with pytest.raises(SourceFileError, match="outside the folder"):
        save_to_disk_files(d)


def test_parquet_with_column_chunks_in_another_file_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pf_trl.data.source_files import SourceFileError, check_source_files

    part = tmp_path / "part.parquet"
    pq.write_table(pa.table({"prompt": ["q"], "completion": ["a"]}), str(part))
    assert check_source_files(part) == [part]  # negative control: a self-contained file passes
    meta = pq.read_metadata(str(part))
    meta.set_file_path("../../etc/elsewhere.parquet")
    meta.write_metadata_file(str(tmp_path / "summary.parquet"))
    with pytest.raises(SourceFileError, match="lives in another file"):
        check_source_files(tmp_path / "summary.parquet")


# ------------------------------------------------------------------------------------------- limits
def _limits(**kw):
    from pf_trl.data.source_limits import SourceLimits

    return SourceLimits(**kw)


def test_line_and_depth_limits_name_the_line(tmp_path):
    from pf_trl.data.source_limits import SourceLimitError, check_source_limits

    rows = [json.dumps({"prompt": f"q{i}", "completion": "a"}) for i in range(5)]
    ok = tmp_path / "ok.jsonl"
    ok.write_text("\n".join(rows + ['{"prompt": "[[[[[[[[ {{{{ \\"]]]]", "completion": "x"}']) + "\n")
    assert check_source_limits(ok, _limits(max_json_depth=3)) == 6  # brackets inside strings do not nest
    long = tmp_path / "long.jsonl"
    long.write_text("\n".join(rows[:2] + ['{"prompt": "' + "x" * 5000 + '", "completion": "a"}']) + "\n")
    with pytest.raises(SourceLimitError, match=r"line 3 is longer than 4096 bytes"):
        check_source_limits(long, _limits(max_row_bytes=4096))
    for deep in ("[" * 70 + "]" * 70, '{"a":' * 70 + "1" + "}" * 70):
        f = tmp_path / "deep.jsonl"
        f.write_text("\n".join(rows[:3] + ['{"prompt": ' + deep + ', "completion": "a"}']) + "\n")
        with pytest.raises(SourceLimitError, match=r"line 4 nests arrays/objects deeper than 64 levels"):
            check_source_limits(f, _limits())
    array = tmp_path / "array.json"
    array.write_text("[" + ",".join(['{"prompt": ' + "[" * 70 + "]" * 70 + "}"]) + "]")
    with pytest.raises(SourceLimitError, match="deeper than 64"):
        check_source_limits(array, _limits())


def test_a_200mb_line_is_refused_in_bounded_memory(tmp_path):
    import tracemalloc

    from pf_trl.data.source_limits import SourceLimitError, check_source_limits

    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        f.write('{"prompt": "')
        for _ in range(200):
            f.write("y" * 2**20)
        f.write('", "completion": "a"}\n')
    tracemalloc.start()
    with pytest.raises(SourceLimitError, match="line 1 is longer than 4194304 bytes"):
        check_source_limits(big, _limits(max_row_bytes=4 * 2**20))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 16 * 2**20, peak  # a small multiple of max_row_bytes in hand, never the 200 MB line


def test_parquet_decompression_bomb_is_refused_from_its_metadata(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pf_trl.data.source_limits import SourceLimitError, check_source_limits

    bomb = tmp_path / "bomb.parquet"
    pq.write_table(pa.table({"prompt": ["a" * (8 * 2**20)] * 12, "completion": ["b"] * 12}), str(bomb),
                   compression="zstd", use_dictionary=False)
    assert bomb.stat().st_size < 2**20  # ~100 MB of text in well under a megabyte
    with pytest.raises(SourceLimitError, match=r"row group 0 holds \d+ bytes uncompressed"):
        check_source_limits(bomb, _limits(max_row_group_bytes=64 * 2**20))
    check_source_limits(bomb, _limits())  # under the default 1 GiB: accepted


def test_loaded_rows_over_the_field_limit_are_refused_by_pretokenize(tmp_path, tokenizer):
    from pf_trl.data.pretokenize import PretokenizeError, pretokenize

    src = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "q\n", "completion": "a" * 3000}] * 3)
    with pytest.raises(PretokenizeError, match=r"column 'completion' holds a value of 3000 bytes, more than 1024"):
        pretokenize(src, tmp_path / "out", tokenizer=tokenizer, progress=False, limits=_limits(max_field_bytes=1024))
    assert not (tmp_path / "out").exists()
    assert pretokenize(src, tmp_path / "out", tokenizer=tokenizer, progress=False)["counts"]["examples"] == 3


# ------------------------------------------------------------------------------------- cut before tokenizing
def _long_texts() -> list[str]:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9))) for _ in range(2000)]
    return [" ".join(rng.choice(words) for _ in range(30000)),
            "x" + " " * 200000 + "y",
            "a" * 150000,
            "".join(rng.choice("héllo wörld 你好 🤗 \n\t### Response:") for _ in range(150000)),
            "".join(rng.choice("0123456789") for _ in range(150000))]


@pytest.mark.parametrize("max_tokens", [37, 1024])
def test_cut_text_gives_the_tokens_and_labels_of_the_whole_text(tokenizer, max_tokens):
    from pf_trl.data import formats

    texts = _long_texts()
    spans = [[(3, 900), (1500, len(t))] for t in texts]
    ids, labels, cut = formats.encode_spans_capped(tokenizer, texts, spans, add_special_tokens=True,
                                                   max_tokens=max_tokens)
    whole_ids, whole_labels = formats.encode_spans(tokenizer, texts, spans, add_special_tokens=True)
    assert all(cut), "every text is far longer than max_tokens: each must be cut"
    for i in range(len(texts)):
        assert len(ids[i]) > max_tokens and len(whole_ids[i]) > len(ids[i])
        assert ids[i][:max_tokens] == whole_ids[i][:max_tokens]
        assert labels[i][:max_tokens] == whole_labels[i][:max_tokens]


def test_cut_is_refused_when_the_prefix_cannot_be_shown_to_agree(tokenizer, monkeypatch):
    """A prefix that does not reach max_tokens tokens (e.g. a normalizer deleting text) -> the whole text."""
    from pf_trl.data import formats

    monkeypatch.setattr(formats, "_max_token_chars", lambda tok: 1)  # claims 1 char per token: prefixes too short
    text = "hello world " * 5000
    ids, _, cut = formats.encode_spans_capped(tokenizer, [text], [[(0, len(text))]], add_special_tokens=True,
                                              max_tokens=2000)
    whole, _ = formats.encode_spans(tokenizer, [text], [[(0, len(text))]], add_special_tokens=True)
    assert cut == [False] and ids[0] == whole[0]


@pytest.mark.parametrize("truncation", ["truncate", "drop"])
def test_pretokenize_with_the_cut_equals_pretokenize_without(tmp_path, tokenizer, monkeypatch, truncation):
    import datasets

    from pf_trl.data import formats
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize

    texts = _long_texts()
    rows = [{"prompt": "Summarize:\n", "completion": t} for t in texts] + [{"prompt": "q\n", "completion": "short"}]
    src = write_jsonl(tmp_path / "long.jsonl", rows)
    config = PretokenizeConfig(max_seq_len=256, truncation=truncation)
    cut = pretokenize(src, tmp_path / "cut", config, tokenizer=tokenizer, progress=False)
    monkeypatch.setattr(formats, "_encode_prefix", lambda *a, **k: None)  # reference: tokenize every text whole
    whole = pretokenize(src, tmp_path / "whole", config, tokenizer=tokenizer, progress=False)
    # the same rows and counts; the supervised tokens lost beyond a prefix were never tokenized: a lower bound
    lost = "loss_tokens_lost", "loss_tokens_lost_at_least"
    assert {k: v for k, v in cut["counts"].items() if k not in lost} == \
        {k: v for k, v in whole["counts"].items() if k not in lost}
    assert cut["counts"]["loss_tokens_lost_at_least"] and not whole["counts"]["loss_tokens_lost_at_least"]
    assert 0 < cut["counts"]["loss_tokens_lost"] <= whole["counts"]["loss_tokens_lost"]
    a, b = datasets.load_from_disk(str(tmp_path / "cut")), datasets.load_from_disk(str(tmp_path / "whole"))
    assert a["input_ids"][:] == b["input_ids"][:] and a["labels"][:] == b["labels"][:]
    if truncation == "truncate":
        assert cut["counts"]["truncated"] == len(texts)


def test_truncation_error_on_a_cut_row_says_more_than(tmp_path, tokenizer):
    from pf_trl.data.pretokenize import PretokenizeConfig, PretokenizeError, pretokenize

    src = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "q\n", "completion": "word " * 100000}])
    with pytest.raises(PretokenizeError, match=r"longer than max_seq_len 128 \(first: row 0, more than \d+ tokens\)"):
        pretokenize(src, tmp_path / "o", PretokenizeConfig(max_seq_len=128, truncation="error"), tokenizer=tokenizer,
                    progress=False)
