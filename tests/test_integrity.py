"""Per-file checksums of shards directories: written with the manifest, verified by load_shards (so by
`pf-trl train` and every trainer path), by `pf-trl verify`, streamed in constant memory."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from in_process import run_cli

from conftest import write_jsonl
from test_service_support import REPO


def _shards(tmp_path: Path, name: str = "shards", rows: int = 60) -> Path:
    from pf_trl.data.pretokenize import pretokenize

    src = write_jsonl(tmp_path / f"{name}.jsonl", [{"prompt": f"Question {i}?\n", "completion": f"Answer {i}."}
                                                   for i in range(rows)])
    out = tmp_path / name
    pretokenize(src, out, progress=False)
    return out


def flip_token(shards: Path) -> Path:
    """Change one token id inside the input_ids data of a shard: one byte, the file stays valid Arrow."""
    import pyarrow as pa

    arrow = sorted(shards.glob("*.arrow"))[0]
    with pa.memory_map(str(arrow)) as source:
        values = pa.ipc.open_stream(source).read_all().column("input_ids").chunk(0).values
    needle = np.asarray(values[3:9]).astype("<i4").tobytes()
    data = bytearray(arrow.read_bytes())
    at = bytes(data).find(needle)
    assert at > 0
    data[at] ^= 0x01
    arrow.write_bytes(bytes(data))
    return arrow


def test_manifest_carries_a_checksum_of_every_other_file(tmp_path):
    from pf_trl.data.integrity import file_digest
    from pf_trl.data.shards import MANIFEST_FILE, read_manifest

    out = _shards(tmp_path)
    manifest = read_manifest(out)
    files = manifest["checksums"]["files"]
    on_disk = {p.name for p in out.iterdir() if p.name != MANIFEST_FILE}
    assert set(files) == on_disk and any(n.endswith(".arrow") for n in files) and "state.json" in files
    assert manifest["checksums"]["algorithm"] == "xxh3_128"
    for name, entry in files.items():
        assert entry["bytes"] == (out / name).stat().st_size
        assert entry["digest"] == file_digest(out / name, "xxh3_128")


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256", "blake3", "crc32c"])
def test_streaming_digest_equals_the_digest_of_the_whole_file(tmp_path, algorithm):
    import tracemalloc

    from pf_trl.data.integrity import HASHERS, file_digest

    if algorithm in ("blake3", "crc32c"):
        pytest.importorskip({"blake3": "blake3", "crc32c": "google_crc32c"}[algorithm])
    path = tmp_path / "blob"
    rng = np.random.default_rng(0)
    path.write_bytes(rng.integers(0, 256, 24 * 2**20 + 12345, dtype=np.uint8).tobytes())
    whole = HASHERS[algorithm]()
    whole.update(path.read_bytes())
    tracemalloc.start()
    streamed = file_digest(path, algorithm, block_bytes=1 << 20)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert streamed == whole.hexdigest()
    assert peak < 4 * 2**20, f"hashing a 24 MB file held {peak} bytes: it must stream"


def test_a_flipped_byte_is_refused_by_name_and_only_the_check_catches_it(tmp_path):
    from pf_trl.data.shards import ShardsError, load_shards

    out = _shards(tmp_path)
    before = [list(r) for r in load_shards(out)["input_ids"]]
    arrow = flip_token(out)
    # Negative control: without the check the changed token is read as if nothing happened.
    changed = [list(r) for r in load_shards(out, verify=False)["input_ids"]]
    assert changed != before
    with pytest.raises(ShardsError, match=rf"{arrow.name} does not match its xxh3_128 checksum.*re-run `pf-trl pretokenize`"):
        load_shards(out)


def test_truncated_or_missing_files_are_named(tmp_path):
    from pf_trl.data.shards import ShardsError, load_shards

    out = _shards(tmp_path)
    arrow = sorted(out.glob("*.arrow"))[0]
    with open(arrow, "r+b") as f:
        f.truncate(arrow.stat().st_size - 10)
    with pytest.raises(ShardsError, match=rf"{arrow.name} has \d+ bytes, the manifest says \d+"):
        load_shards(out)
    arrow.unlink()
    with pytest.raises(ShardsError, match=rf"{arrow.name} is missing"):
        load_shards(out)


def test_the_trainer_data_path_refuses_a_corrupt_cached_dataset(tmp_path, monkeypatch, tokenizer):
    """What `pf-trl train` and PaddingFreeSFTTrainer do with a data file: the content-addressed cache; a cache hit
    whose shards changed is refused, naming the shard, instead of trained on."""
    from pf_trl.data.pretokenize import PretokenizeConfig
    from pf_trl.data.sources import DataSourceError, cached_shards, load_training_data

    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))
    src = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"Q{i}\n", "completion": f"A{i}"} for i in range(40)])
    config = PretokenizeConfig()
    assert load_training_data(str(src), tokenizer, config).num_rows == 40
    arrow = flip_token(cached_shards(str(src), tokenizer, config))
    with pytest.raises(DataSourceError, match=rf"{arrow.name} does not match"):
        load_training_data(str(src), tokenizer, config)


def test_a_manifest_without_checksums_still_loads(tmp_path):
    """Shards written before checksums were recorded open as before (nothing to verify)."""
    from pf_trl.data.shards import MANIFEST_FILE, load_shards, verify_shards

    out = _shards(tmp_path)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    del manifest["checksums"]
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert verify_shards(out) == 0
    assert load_shards(out).num_rows == 60


def _verify(*args: str) -> subprocess.CompletedProcess:
    # in the test's process (tests/in_process.py): the claims are the command's exit status and output
    return run_cli(["verify", *args], env=dict(os.environ), cwd=REPO)


def test_pf_trl_verify_command(tmp_path):
    good, bad = _shards(tmp_path, "good"), _shards(tmp_path, "bad")
    r = _verify(str(good))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"ok       {good}: 4 files") and "xxh3_128" in r.stdout  # pf_lengths.npy too
    arrow = flip_token(bad)
    r = _verify(str(tmp_path))  # a directory of shards directories
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"CORRUPT  {bad}: ") and arrow.name in lines[0]
    assert lines[1].startswith(f"ok       {good}")
    assert "1 of 2 shards directories are corrupt" in r.stderr
    js = _verify(str(bad), "--json")
    assert js.returncode == 1 and json.loads(js.stdout)["ok"] is False
    missing = _verify(str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stderr.startswith("pf-trl verify: error: ") and "no such file" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


def test_merged_k8s_shards_carry_checksums(tmp_path):
    """Every writer of a manifest (here: the Indexed Job's merge) records checksums, since write_manifest does."""
    from pf_trl.data.shards import read_manifest, verify_shards, write_manifest

    out = _shards(tmp_path)
    manifest = read_manifest(out)
    manifest.pop("checksums")
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    write_manifest(copy, manifest)
    assert verify_shards(copy) == sum(e["bytes"] for e in read_manifest(copy)["checksums"]["files"].values()) > 0
    assert hashlib.sha256((copy / "state.json").read_bytes()).hexdigest()  # the files themselves untouched


@pytest.mark.slow
def test_pf_trl_train_refuses_a_corrupt_shards_directory_at_start(tmp_path):
    """The path users run: `pf-trl train` on shards whose Arrow data changed exits 2 naming the shard, before any
    step (negative control: the intact copy trains)."""
    good = _shards(tmp_path, "good", rows=24)
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    arrow = flip_token(bad)

    def train(data: Path, out: str) -> subprocess.CompletedProcess:
        # in the test's process (tests/in_process.py): the claim is the command's exit status and its one line
        return run_cli(["train", "--model_name_or_path", "pf-trl/tiny-llama", "--training_data_path", str(data),
                        "--max_steps", "1", "--output_dir", str(tmp_path / out), "--report_to", "none",
                        "--save_strategy", "no"], env=dict(os.environ), cwd=REPO)

    r = train(bad, "out-bad")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"{arrow.name} does not match its xxh3_128 checksum" in r.stderr
    assert train(good, "out-good").returncode == 0
