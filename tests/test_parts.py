"""Datasets of many parts (pf_trl.data.parts): written by the Indexed Job's slices, read without a merge copy by
load_shards, `pf-trl train`, `pf-trl inspect` and `pf-trl verify`; a part missing or changed refused in one line;
the Indexed Job's plan never visible half-written."""

from __future__ import annotations

import importlib.util
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from conftest import write_jsonl

ROOT = Path(__file__).resolve().parents[1]
TINY = "num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pretokenize_slice = _load("pf_trl_k8s_pretokenize_slice_parts", ROOT / "k8s" / "scripts" / "pretokenize_slice.py")
merge_shards = _load("pf_trl_k8s_merge_shards_parts", ROOT / "k8s" / "scripts" / "merge_shards.py")


def _rows(start: int, stop: int) -> list[dict]:
    # prompt/completion rows of ~10 to ~60 tokens, a few cut by max_seq_len 48 (their counts must add up too)
    return [{"prompt": f"### Instruction:\nCount to {i}.\n\n### Response:\n",
             "completion": f"{i}, " * (2 + 2 * (i % 13))} for i in range(start, stop)]


@pytest.fixture(scope="module")
def data(tmp_path_factory, tokenizer):
    """Three slices through pretokenize_slice.py (the Indexed Job's launcher, committing the parts directory as one
    dataset), the whole source pretokenized in one process, and the parts compacted by merge_shards.py."""
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize

    root = tmp_path_factory.mktemp("parts")
    flags = ["--max_seq_len", "48", "--truncation", "truncate", "--no_progress"]
    slices = [(0, 30), (30, 70), (70, 96)]
    for i, (a, b) in enumerate(slices):
        src = write_jsonl(root / f"src-{i}.jsonl", _rows(a, b))
        assert not (root / "parts" / "pf_manifest.json").exists(), "committed before its last slice"
        pretokenize_slice.run_slice(root / "parts", i, len(slices), str(src), flags)
    whole = write_jsonl(root / "whole.jsonl", _rows(0, 96))
    pretokenize(whole, root / "whole", PretokenizeConfig(max_seq_len=48, truncation="truncate"), tokenizer=tokenizer,
                progress=False)
    merge_shards.merge(root / "parts", root / "merged")
    return root


def test_parts_read_as_one_dataset_without_a_copy(data, tokenizer):
    from pf_trl.data.identity import check_dataset_identity
    from pf_trl.data.shards import load_shards
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    ds = load_shards(data / "parts", expected_tokenizer=tokenizer_fingerprint(tokenizer))
    whole = load_shards(data / "whole")
    assert ds["input_ids"] == whole["input_ids"] and ds["labels"] == whole["labels"]
    m, w = ds.pf_manifest, whole.pf_manifest
    assert [p["name"] for p in m["parts"]] == ["part-0", "part-1", "part-2"]
    for key in ("source_rows", "examples", "tokens", "loss_tokens", "truncated", "too_long", "loss_tokens_lost",
                "dropped"):
        assert m["counts"][key] == w["counts"][key], key
    assert m["counts"]["truncated"] > 0
    assert m["lengths"] == w["lengths"]
    # no data copied: every Arrow file the dataset maps lies inside a part directory
    files = {Path(f["filename"]).parent.name for f in ds.cache_files}
    assert files == {"part-0", "part-1", "part-2"}
    assert not list((data / "parts").glob("*.arrow"))
    # the sampler's lengths: every part's, in order (also kept beside the manifest for a bucket reader)
    import numpy as np

    assert np.load(data / "parts" / "pf_lengths.npy").tolist() == whole["length"]
    check_dataset_identity(ds, tokenizer_fingerprint(tokenizer))  # same tokenizer: accepted


@pytest.mark.slow
def test_parts_train_to_the_losses_of_the_merged_copy(data, tmp_path):
    """`pf-trl train --training_data_path PARTS` against its merged single-part equivalent: the same batches, the same
    ops in the same order, so the losses are bit-equal."""
    from pf_trl.cli.main import main

    losses = {}
    for name in ("parts", "merged"):
        out = tmp_path / name
        rc = main(["train", "--model_name_or_path", "pf-trl/tiny-llama", "--model_overrides", TINY,
                   "--training_data_path", str(data / name), "--output_dir", str(out), "--max_seq_len", "48",
                   "--max_steps", "3", "--per_device_train_batch_size", "4", "--logging_steps", "1",
                   "--save_strategy", "steps", "--save_steps", "3", "--report_to", "none", "--disable_tqdm", "True"])
        assert rc == 0
        state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
        losses[name] = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses["parts"]) == 3
    assert losses["parts"] == losses["merged"]


def test_inspect_and_verify_read_parts(data, capsys):
    from pf_trl.cli.main import main

    assert main(["inspect", str(data / "parts"), "--max_tokens", "256"]) == 0
    out = capsys.readouterr().out
    assert "3 parts (part-0 .. part-2), written by indexed-job" in out and "budget 256:" in out
    assert main(["verify", str(data / "parts")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok ") and "part-" not in out.split(":")[0]  # one line for the dataset, not per part


@pytest.mark.parametrize("damage", ["part_missing", "part_file_changed", "part_manifest_changed"])
def test_a_missing_or_changed_part_is_refused_in_one_line(data, tmp_path, capsys, damage):
    from pf_trl.cli.main import main
    from pf_trl.data.shards import ShardsError, load_shards

    copy = tmp_path / "parts"
    shutil.copytree(data / "parts", copy)
    load_shards(copy)  # the intact copy loads: the negative control
    if damage == "part_missing":
        shutil.rmtree(copy / "part-1")
        expected = "part-1/"
    elif damage == "part_file_changed":
        (arrow,) = (copy / "part-2").glob("data-*.arrow")
        raw = bytearray(arrow.read_bytes())
        raw[-20] ^= 0xFF
        arrow.write_bytes(bytes(raw))
        expected = f"part-2/{arrow.name}"
    else:
        path = copy / "part-0" / "pf_manifest.json"
        manifest = json.loads(path.read_text())
        manifest["counts"]["examples"] += 1
        path.write_text(json.dumps(manifest))
        expected = "part-0/pf_manifest.json"
    with pytest.raises(ShardsError, match=expected):
        load_shards(copy)
    assert main(["verify", str(copy)]) == 1
    line = capsys.readouterr().out.strip()
    assert line.startswith("CORRUPT") and expected in line and "\n" not in line
    if damage == "part_missing":  # without checksum verification the missing part is still named
        with pytest.raises(ShardsError, match="part part-1 listed by the dataset manifest is missing"):
            load_shards(copy, verify=False)


def test_the_plan_is_never_read_half_written(tmp_path, monkeypatch):
    """Eight slices start at once on a parts directory; the plan's writer stalls mid-write. Every index reads the whole
    plan (before the fix, one created slices.json and wrote it afterwards: an index reading it in between failed with
    "Expecting value: line 1 column 1")."""
    real_dump = json.dump

    def slow_dump(obj, f, **kw):
        text = json.dumps(obj, **kw)
        f.write(text[: len(text) // 2])
        f.flush()
        time.sleep(0.3)  # a slow disk: the other indexes get there meanwhile
        f.write(text[len(text) // 2:])

    monkeypatch.setattr(pretokenize_slice.json, "dump", slow_dump)
    errors: list[BaseException] = []

    def one_index():
        try:
            pretokenize_slice.check_plan(tmp_path, 8, ["--max_seq_len", "48"])
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=one_index) for _ in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join()
    monkeypatch.setattr(pretokenize_slice.json, "dump", real_dump)
    assert errors == []
    plan = json.loads((tmp_path / "slices.json").read_text())
    assert plan == {"count": 8, "pretokenize_flags": ["--max_seq_len", "48"]}
    assert not list(tmp_path.glob(".slices.json.tmp-*"))
    with pytest.raises(pretokenize_slice.SliceError, match="holds a run of 8 slices"):
        pretokenize_slice.check_plan(tmp_path, 4, ["--max_seq_len", "48"])


def test_engine_ray_without_ray_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """No Ray installed (its import fails, as in a venv without the extra): one line naming pf-trl[ray], nothing
    written. The Python API refuses the same way."""
    import sys

    from pf_trl import pretokenize
    from pf_trl.cli.main import main
    from pf_trl.data.pretokenize import PretokenizeError

    src = write_jsonl(tmp_path / "rows.jsonl", _rows(0, 4))
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["pretokenize", str(src), str(tmp_path / "out"), "--engine", "ray"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pf-trl pretokenize: error: --engine ray needs Ray Data")
    assert "pip install 'pf-trl[ray]'" in err
    assert "\n" not in err and not (tmp_path / "out").exists()
    with pytest.raises(PretokenizeError, match=r"pf-trl\[ray\]"):
        pretokenize(src, tmp_path / "out", engine="ray")
    assert main(["pretokenize", str(src), str(tmp_path / "out"), "--ray_workers", "2"]) == 2
    assert "--ray_workers and --rows_per_part apply to --engine ray only" in capsys.readouterr().err
