"""Models in a bucket, against a real S3 server (SeaweedFS, tests/s3_server.py): the final model of a run whose
``output_dir`` is a bucket is committed by a marker written last (sizes and checksums), an overwrite leaves nothing
of the previous model, and ``--model_name_or_path s3://...`` (train and pretokenize) reads only a committed prefix,
checked file by file, training to the losses of its local copy.

Every command runs in this process (tests/in_process.py: the console script's entry, a node's environment): the
claims are about what the commands read, write and refuse, not about a process of their own."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from in_process import run_cli
from s3_server import s3_server_or_skip

from pf_trl.storage.committed import MODEL_MARKER

pytestmark = pytest.mark.slow

TINY = "num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,num_key_value_heads=1"
MODEL = "pfm/models/base"


def _run(argv: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return run_cli(argv, env, cwd)


def _train(env, cwd: Path, model: str, data: str, out: str, *extra: str) -> subprocess.CompletedProcess:
    return _run(["train", "--model_name_or_path", model, *extra, "--training_data_path", data,
                 "--output_dir", out, "--max_steps", "3", "--logging_steps", "1", "--max_tokens_per_batch", "256",
                 "--max_seq_len", "128", "--seed", "0", "--report_to", "none", "--use_cpu", "True",
                 "--learning_rate", "1e-3", "--dataloader_num_workers", "0", "--disable_tqdm", "True"], env, cwd)


def _losses(out: Path) -> list[float]:
    state = json.loads(next(out.glob("checkpoint-*/trainer_state.json")).read_text())
    return [row["loss"] for row in state["log_history"] if "loss" in row]


@pytest.fixture(scope="module")
def bucket_model(tmp_path_factory, sample_path):
    """A tiny model trained by `pf-trl train` into s3://pfm/models/base, over an older 3-shard model's files."""
    root = tmp_path_factory.mktemp("bucket-models")
    s3 = s3_server_or_skip(root / "s3")
    s3.make_bucket("pfm")
    fs = s3.filesystem()
    env = {**os.environ, **s3.env(), "PF_TRL_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    data = root / "train.jsonl"
    data.write_text("".join(sample_path.read_text().splitlines(keepends=True)[:40]))
    # what an earlier run left there: a committed 3-shard model
    old = {f"model-0000{i}-of-00003.safetensors": b"old weights %d" % i for i in (1, 2, 3)}
    old["model.safetensors.index.json"] = b"{}"
    for name, body in old.items():
        fs.pipe(f"{MODEL}/{name}", body)
    fs.pipe(f"{MODEL}/{MODEL_MARKER}", json.dumps({"checksums": {"algorithm": "xxh3_128", "files": {
        n: {"bytes": len(b), "digest": "0"} for n, b in old.items()}}}).encode())
    done = _train(env, root, "pf-trl/tiny-llama", str(data), f"s3://{MODEL}", "--model_overrides", TINY)
    assert done.returncode == 0, done.stderr[-3000:]
    yield {"s3": s3, "fs": fs, "env": env, "root": root, "data": data, "old": old}
    s3.stop()


def test_the_final_model_is_committed_last_and_replaces_the_previous_one(bucket_model):
    fs = bucket_model["fs"]
    listed = {p[len(MODEL) + 1:]: int(i["size"]) for p, i in fs.find(MODEL, detail=True).items()}
    assert not set(bucket_model["old"]) & set(listed)  # nothing of the 3-shard model is left
    marker = json.loads(fs.cat(f"{MODEL}/{MODEL_MARKER}"))
    files = marker["checksums"]["files"]
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(files)
    assert not any(n.startswith("checkpoint-") for n in files)  # checkpoints are committed by their own markers
    for name, entry in files.items():
        assert listed[name] == entry["bytes"] and len(entry["digest"]) == 32, name
    assert any(n.startswith("checkpoint-") for n in listed)  # the run's checkpoint stays beside the model


def test_a_bucket_model_trains_to_its_local_copys_losses_and_brings_its_tokenizer(bucket_model):
    fs, env, root = bucket_model["fs"], bucket_model["env"], bucket_model["root"]
    local_model = root / "local-model"
    local_model.mkdir()
    for name in json.loads(fs.cat(f"{MODEL}/{MODEL_MARKER}"))["checksums"]["files"]:
        if "/" not in name:
            fs.get(f"{MODEL}/{name}", str(local_model / name))
    # pretokenize with the bucket model's tokenizer: its tokenizer files come, its weights do not
    tok_env = {**env, "PF_TRL_CACHE": str(root / "tok-cache")}
    shards = root / "shards"
    made = _run(["pretokenize", str(bucket_model["data"]), str(shards), "--model_name_or_path",
                 f"s3://{MODEL}", "--max_seq_len", "128", "--no_progress"], tok_env, root)
    assert made.returncode == 0, made.stderr[-3000:]
    fetched = [p.name for p in (root / "tok-cache" / "remote").rglob("*") if p.is_file()]
    assert "tokenizer.json" in fetched and not [n for n in fetched if n.endswith(".safetensors")], fetched

    from_bucket = _train(env, root, f"s3://{MODEL}", str(shards), str(root / "from-bucket"))
    assert from_bucket.returncode == 0, from_bucket.stderr[-3000:]
    from_local = _train(env, root, str(local_model), str(shards), str(root / "from-local"))
    assert from_local.returncode == 0, from_local.stderr[-3000:]
    losses = _losses(root / "from-bucket")
    assert len(losses) == 3 and losses == _losses(root / "from-local")  # the same file loaded: bit-equal


def test_an_uncommitted_or_changed_bucket_model_is_refused_in_one_line(bucket_model):
    fs, env, root = bucket_model["fs"], bucket_model["env"], bucket_model["root"]
    files = json.loads(fs.cat(f"{MODEL}/{MODEL_MARKER}"))["checksums"]["files"]
    for name in files:
        if "/" in name:
            continue
        body = bytearray(fs.cat(f"{MODEL}/{name}"))
        fs.pipe(f"pfm/models/uncommitted/{name}", bytes(body))
        if name == "model.safetensors":
            body[len(body) // 2] ^= 0xFF  # same size, other bytes: only the checksum tells
        fs.pipe(f"pfm/models/changed/{name}", bytes(body))
    fs.pipe(f"pfm/models/changed/{MODEL_MARKER}", fs.cat(f"{MODEL}/{MODEL_MARKER}"))
    for prefix, expected in (("uncommitted", f"no {MODEL_MARKER} there, so it is not a committed pf-trl model"),
                             ("changed", "model.safetensors does not match its xxh3_128 checksum")):
        proc = _train(env, root, f"s3://pfm/models/{prefix}", str(bucket_model["data"]), str(root / prefix))
        assert proc.returncode == 2, proc.stderr[-3000:]
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith("pf-trl train: error: ") and f"s3://pfm/models/{prefix}" in line, proc.stderr[-3000:]
        assert expected in line, line
    assert not fs.exists(f"pfm/models/changed/{MODEL_MARKER}.tmp")
    # nothing of the changed model kept in the node cache: the next run downloads and checks it again
    kept = [p for p in (root / "cache" / "remote").glob("*/model.safetensors")]
    assert all(p.read_bytes() == fs.cat(f"{MODEL}/model.safetensors") for p in kept)


def test_commit_prefix_removes_a_third_shard_and_uncommits_while_it_uploads(bucket_model, tmp_path, monkeypatch):
    from pf_trl.storage import filesystem as storage_fs
    from pf_trl.storage.committed import commit_prefix, read_commit

    for key, value in bucket_model["s3"].env().items():
        monkeypatch.setenv(key, value)
    storage_fs.forget_filesystems()
    fs = bucket_model["fs"]
    three = {f"model-0000{i}-of-00003.safetensors": os.urandom(100 + i) for i in (1, 2, 3)}
    two = {f"model-0000{i}-of-00002.safetensors": os.urandom(200 + i) for i in (1, 2)}
    for files, folder in ((three, tmp_path / "three"), (two, tmp_path / "two")):
        folder.mkdir()
        for name, body in files.items():
            (folder / name).write_bytes(body)
    seen: list[bool] = []
    put = storage_fs.filesystem("s3://pfm").put

    def watching_put(*args, **kwargs):  # what a consumer would find while the new files upload
        seen.append(fs.exists(f"pfm/models/c/{MODEL_MARKER}"))
        return put(*args, **kwargs)

    commit_prefix(tmp_path / "three", "s3://pfm/models/c", sorted(three))
    monkeypatch.setattr(storage_fs.filesystem("s3://pfm"), "put", watching_put)
    commit_prefix(tmp_path / "two", "s3://pfm/models/c", sorted(two))
    assert seen == [False]  # uncommitted during the upload: refused, never read half old, half new
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find("pfm/models/c")) == sorted([*two, MODEL_MARKER])
    files, _ = read_commit("s3://pfm/models/c")
    assert set(files) == set(two)
    storage_fs.forget_filesystems()
