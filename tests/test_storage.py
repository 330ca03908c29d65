"""Object storage (pf_trl.storage) against a real S3 server the tests start (SeaweedFS, tests/s3_server.py):
URIs and the credential chain's messages, datasets committed by their manifest written last and read back through
the node cache (one download per node, verified, bounded), refusals in one line."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest
from in_process import run_cli
from s3_server import s3_server_or_skip

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = s3_server_or_skip(tmp_path_factory.mktemp("s3"))
    server.make_bucket("pfdata")
    yield server
    server.stop()


@pytest.fixture
def bucket_env(s3, monkeypatch, tmp_path):
    """This process reaches the server through the AWS environment, with a node cache of its own."""
    from pf_trl.storage import filesystem

    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "node"))
    filesystem.forget_filesystems()
    yield s3
    filesystem.forget_filesystems()


def test_uris_are_parsed_in_one_place():
    from pathlib import PurePosixPath

    from pf_trl.storage import StorageError, is_remote, parse_uri

    assert [is_remote(u) for u in ("s3://b/k", "gs://b/k", "gcs://b", "az://c/k", "abfs://c/k", "abfss://c/k")] == [
        True] * 6
    assert not any(is_remote(u) for u in ("data/x.jsonl", "/abs/s3://x", "hf://datasets/x", PurePosixPath("s3://b")))
    uri = parse_uri("s3://bkt/datasets/name/")
    assert (uri.bucket, uri.key, uri.protocol, str(uri.join("w-1", "a.arrow"))) == (
        "bkt", "datasets/name", "s3", "s3://bkt/datasets/name/w-1/a.arrow")
    assert parse_uri("gs://b/x").protocol == "gcs" and parse_uri("abfss://c/x").protocol == "abfs"
    with pytest.raises(StorageError, match="no bucket named"):
        parse_uri("s3:///key")


def test_each_cloud_names_where_credentials_come_from(monkeypatch, tmp_path):
    from pf_trl.storage.credentials import credential_source

    for name in list(os.environ):
        if name.startswith(("AWS_", "AZURE_", "GOOGLE_", "STORAGE_EMULATOR_HOST")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert "instance metadata" in credential_source("s3") and "AWS S3" in credential_source("s3")
    monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::1:role/pf")
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", "/var/run/secrets/token")
    assert "IRSA: role arn:aws:iam::1:role/pf" in credential_source("s3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE1234")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:9000")
    said = credential_source("s3")
    assert "AWS_ACCESS_KEY_ID ...1234 without AWS_SECRET_ACCESS_KEY" in said and "endpoint http://minio:9000" in said
    assert "AKIAEXAMPLE" not in said
    assert "metadata server (Workload Identity" in credential_source("gcs")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "sa.json"))
    assert "sa.json: no such file" in credential_source("gcs")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9023")  # gcsfs's emulator variable: no credentials
    assert credential_source("gcs") == "no credentials, the emulator at STORAGE_EMULATOR_HOST=http://127.0.0.1:9023"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "default")  # gcsfs's word for GCS itself
    assert "sa.json: no such file" in credential_source("gcs")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    assert "DefaultAzureCredential for account acct" in credential_source("az")
    monkeypatch.setenv("AZURE_CLIENT_ID", "cid")
    monkeypatch.setenv("AZURE_FEDERATED_TOKEN_FILE", "/t")
    assert "workload identity (AZURE_CLIENT_ID cid" in credential_source("abfs")
    monkeypatch.setenv("AZURE_STORAGE_KEY", "secret")
    assert "account key of acct" in credential_source("az") and "secret" not in credential_source("az")


def test_gcs_and_azure_filesystems_come_from_their_packages(monkeypatch):
    """gcsfs and adlfs are installed (the cloud extra) and serve gs:// and az:// (no request is made here)."""
    from pf_trl.storage.filesystem import filesystem, forget_filesystems

    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    monkeypatch.setenv("AZURE_STORAGE_KEY", "a2V5")
    assert type(filesystem("az://container/x")).__module__.startswith("adlfs")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "")
    import gcsfs  # (creating one for GCS itself would probe the metadata server)

    # for an emulator: no credentials, and gcsfs's JSON-API filesystem (its default one, gcsfs.GCSFileSystem, asks
    # GCS's Storage Control gRPC API for each bucket's layout); tests/test_bucket_gcs.py runs it against one
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    forget_filesystems()
    try:
        fs = filesystem("gs://bucket/x")
    finally:
        forget_filesystems()
    assert type(fs) is gcsfs.core.GCSFileSystem  # not a subclass: the ExtendedGcsFileSystem
    assert fs.credentials.method == "anon" and fs._location == "http://127.0.0.1:9"


def _pretokenize(env, source, dest, *extra):
    """``pf-trl pretokenize`` in this process (tests/in_process.py), with the writer node's environment."""
    return run_cli(["pretokenize", source, dest, "--no_progress", *extra], env, REPO)


ROWS = 300  # of the shipped sample: several shards' worth of bytes, an eighth of the tokenizing


@pytest.fixture(scope="module")
def source_rows(sample_path, tmp_path_factory) -> Path:
    """The first ROWS rows of the shipped sample, as a JSON Lines file."""
    path = tmp_path_factory.mktemp("source") / "train.jsonl"
    path.write_text("".join(sample_path.read_text().splitlines(keepends=True)[:ROWS]))
    return path


@pytest.fixture(scope="module")
def local_shards(source_rows, tmp_path_factory) -> Path:
    """``source_rows`` pretokenized here with the defaults (what the CLI's run must equal)."""
    from pf_trl.data.pretokenize import pretokenize

    out = tmp_path_factory.mktemp("local") / "shards"
    pretokenize(source_rows, out, progress=False)
    return out


@pytest.fixture(scope="module")
def committed(s3, source_rows, tmp_path_factory):
    """``source_rows`` pretokenized by the CLI from a bucket source into a bucket prefix."""
    s3.filesystem().put_file(str(source_rows), "pfdata/src/train.jsonl")
    env = {**os.environ, **s3.env(), "PF_TRL_CACHE": str(tmp_path_factory.mktemp("writer"))}
    done = _pretokenize(env, "s3://pfdata/src/train.jsonl", "s3://pfdata/datasets/sample")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["output_dir"] == "s3://pfdata/datasets/sample"
    assert not list((Path(env["PF_TRL_CACHE"]) / "staging").iterdir())  # the staging copy is gone
    return "s3://pfdata/datasets/sample"


@pytest.mark.slow
def test_pretokenize_commits_a_dataset_that_trains_like_the_local_one(bucket_env, committed, local_shards):
    from pf_trl.data.shards import load_shards
    from pf_trl.data.sources import load_training_data
    from pf_trl.data.tokenizer import resolve_tokenizer

    fs = bucket_env.filesystem()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.find("pfdata/datasets/sample"))
    manifest = json.loads(fs.cat("pfdata/datasets/sample/pf_manifest.json"))
    writer = manifest["storage_files_prefix"]
    listed = manifest["checksums"]["files"]
    assert names == sorted([*listed, "pf_manifest.json"])
    for name, entry in listed.items():  # every file listed with its size and checksum, under the writer's folder
        assert fs.info(f"pfdata/datasets/sample/{writer}/{name}")["size"] == entry["bytes"] and entry["digest"]
    inspected = run_cli(["inspect", committed, "--json"], dict(os.environ), REPO)
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["checksums"] == manifest["checksums"]  # pf-trl inspect reads a bucket too
    remote = load_training_data(committed, resolve_tokenizer(None, None))
    local = load_shards(local_shards)
    assert local.num_rows > ROWS // 2  # rows over the default max_seq_len are dropped, the same on both sides
    assert remote["input_ids"] == local["input_ids"] and remote["labels"] == local["labels"]
    assert remote.cache_files[0]["filename"].startswith(os.environ["PF_TRL_CACHE"])  # memory-mapped from the cache


def _fetch_and_count(uri, counter):
    """In a forked child: the parent's filesystem is not used (one made here), and downloads are counted."""
    from pf_trl.data.remote import local_path
    from pf_trl.storage import cache

    real = cache.download

    def counted(source, target):
        with open(counter, "a") as f:
            f.write(f"{os.getpid()} {source}\n")
        real(source, target)

    cache.download = counted
    print(local_path(uri))


@pytest.mark.slow
def test_ranks_of_one_node_download_once(bucket_env, committed, tmp_path):
    from pf_trl.storage.filesystem import filesystem

    filesystem(committed)  # the parent holds a handle before it forks
    counter = tmp_path / "downloads"
    ctx = multiprocessing.get_context("fork")
    ranks = [ctx.Process(target=_fetch_and_count, args=(committed, counter)) for _ in range(3)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
    assert [p.exitcode for p in ranks] == [0, 0, 0]
    lines = counter.read_text().splitlines()
    assert len(lines) == 4 and len({line.split()[0] for line in lines}) == 1  # 4 files (the lengths too), one process


def test_a_prefix_without_manifest_is_refused(bucket_env, local_shards):
    from pf_trl.data.sources import DataSourceError, check_source_path

    fs = bucket_env.filesystem()
    for p in local_shards.iterdir():
        if p.name != "pf_manifest.json":  # an upload cut short before its commit
            fs.put_file(str(p), f"pfdata/datasets/uncommitted/{p.name}")
    with pytest.raises(DataSourceError) as exc:
        check_source_path("s3://pfdata/datasets/uncommitted", flag="--training_data_path")
    assert "\n" not in str(exc.value)
    assert "s3://pfdata/datasets/uncommitted has no pf_manifest.json" in str(exc.value)


@pytest.mark.slow
def test_a_corrupted_shard_is_refused_and_not_cached(bucket_env, committed):
    from pf_trl.data.remote import local_path, publish_shards
    from pf_trl.data.shards import ShardsError

    # a copy of the committed dataset whose Arrow file is changed in the bucket (same size, other bytes)
    local = local_path(committed)
    publish_shards(local, "s3://pfdata/datasets/corrupt")
    fs = bucket_env.filesystem()
    manifest = json.loads(fs.cat("pfdata/datasets/corrupt/pf_manifest.json"))
    arrow = next(n for n in manifest["checksums"]["files"] if n.endswith(".arrow"))
    key = f"pfdata/datasets/corrupt/{manifest['storage_files_prefix']}/{arrow}"
    data = bytearray(fs.cat(key))
    data[len(data) // 2] ^= 0xFF
    fs.pipe(key, bytes(data))
    with pytest.raises(ShardsError, match=f"s3://pfdata/datasets/corrupt: shard file {arrow} does not match") as exc:
        local_path("s3://pfdata/datasets/corrupt")
    assert "\n" not in str(exc.value)
    assert not [p for p in (Path(os.environ["PF_TRL_CACHE"]) / "remote").iterdir() if p.is_dir() and p != local]
    fs.pipe(key, bytes(data[:-1]))  # cut short: its size differs from the manifest
    from pf_trl.storage import StorageError

    with pytest.raises(StorageError, match="its manifest says"):
        local_path("s3://pfdata/datasets/corrupt")


@pytest.mark.slow
def test_two_writers_never_mix_files(bucket_env, committed, tmp_path):
    """Two pretokenize runs into one prefix: each uploads into its own folder; the last manifest names only its own."""
    from pf_trl.data.remote import local_path, publish_shards
    from pf_trl.data.shards import load_shards, write_manifest
    from pf_trl.storage.datasets import FILES_KEY

    first = Path(local_path(committed))
    second = tmp_path / "second"
    load_shards(first).select(range(10)).save_to_disk(str(second))
    manifest = json.loads((first / "pf_manifest.json").read_text())
    manifest.pop(FILES_KEY)
    manifest["counts"]["examples"] = 10
    write_manifest(second, manifest)
    publish_shards(first, "s3://pfdata/datasets/shared")
    publish_shards(second, "s3://pfdata/datasets/shared", overwrite=True)
    fs = bucket_env.filesystem()
    writers = {p.rsplit("/", 1)[-1] for p in fs.ls("pfdata/datasets/shared") if "/w-" in p}
    assert len(writers) == 2
    assert load_shards(local_path("s3://pfdata/datasets/shared")).num_rows == 10
    from pf_trl.storage import StorageError

    with pytest.raises(StorageError, match="already holds a committed dataset"):
        publish_shards(first, "s3://pfdata/datasets/shared")


@pytest.mark.slow
def test_the_cache_is_bounded(bucket_env, committed, source_rows, monkeypatch):
    from pf_trl.data.remote import local_path
    from pf_trl.storage import StorageError

    monkeypatch.setenv("PF_TRL_REMOTE_CACHE_SIZE", "1KiB")
    with pytest.raises(StorageError, match="do not fit the node cache .* raise PF_TRL_REMOTE_CACHE_SIZE"):
        local_path(committed)
    monkeypatch.setenv("PF_TRL_REMOTE_CACHE_SIZE", "not-a-size")
    with pytest.raises(StorageError, match="is not a size"):
        local_path(committed)
    monkeypatch.delenv("PF_TRL_REMOTE_CACHE_SIZE")
    first = local_path(committed)
    size = sum(p.stat().st_size for p in first.iterdir())
    monkeypatch.setenv("PF_TRL_REMOTE_CACHE_SIZE", str(int(size * 1.5)))
    bucket_env.filesystem().put_file(str(source_rows), "pfdata/src/b.jsonl")
    assert 0.5 * size < source_rows.stat().st_size < 1.5 * size  # fits alone, not beside the first: the test bites
    local_path("s3://pfdata/src/b.jsonl")  # needs room: the least recently used entry goes
    assert not first.exists()


def test_bucket_errors_are_one_line(bucket_env, monkeypatch):
    from pf_trl.data.remote import local_path
    from pf_trl.storage import StorageError, filesystem

    with pytest.raises(StorageError, match=r"s3://nobucket/x.jsonl: bucket nobucket does not exist") as exc:
        local_path("s3://nobucket/x.jsonl")
    assert "credentials from the environment (AWS_ACCESS_KEY_ID" in str(exc.value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    filesystem.forget_filesystems()
    with pytest.raises(StorageError, match=r"s3://pfdata/src/train.jsonl: access denied") as exc:
        local_path("s3://pfdata/src/train.jsonl")
    assert "\n" not in str(exc.value)


def _k8s_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"pf_trl_k8s_{name}", REPO / "k8s" / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_indexed_slices_and_merge_in_a_bucket(bucket_env, sample_rows, capsys):
    """The Indexed pretokenize Job without a shared volume: slices into s3://.../parts, merge into s3://.../datasets;
    the merge waits for every marker, and its result trains like any committed dataset."""
    from pf_trl.data.remote import local_path
    from pf_trl.data.shards import load_shards

    slicer, merger = _k8s_script("pretokenize_slice"), _k8s_script("merge_shards")
    fs = bucket_env.filesystem()
    for i in range(2):
        fs.pipe(f"pfdata/src/slice-{i}.jsonl", "".join(json.dumps(r) + "\n" for r in sample_rows[i * 20:(i + 1) * 20])
                .encode())
    parts = "s3://pfdata/parts/job"
    flags = ["--no_progress", "--max_seq_len", "256"]
    assert slicer.main([parts, "--index", "0", "--count", "2", "--", "s3://pfdata/src/slice-0.jsonl", *flags]) == 0
    assert merger.main([parts, "s3://pfdata/datasets/merged", "--expect", "2"]) == 2  # slice 1 is not done
    assert "1 parts, expected 2" in capsys.readouterr().err
    assert slicer.main([parts, "--index", "1", "--count", "2", "--", "s3://pfdata/src/slice-1.jsonl", *flags]) == 0
    assert slicer.main([parts, "--index", "1", "--count", "3", "--", "s3://pfdata/src/slice-1.jsonl", *flags]) == 2
    assert "holds a run of 2 slices" in capsys.readouterr().err
    assert fs.exists("pfdata/parts/job/part-1.done.json") and fs.exists("pfdata/parts/job/part-1/pf_manifest.json")
    assert merger.main([parts, "s3://pfdata/datasets/merged", "--expect", "2"]) == 0
    merged = load_shards(local_path("s3://pfdata/datasets/merged"))
    one = [load_shards(local_path(f"{parts}/part-{i}")) for i in range(2)]
    assert list(merged["input_ids"]) == list(one[0]["input_ids"]) + list(one[1]["input_ids"])
    assert merger.main([parts, "s3://pfdata/datasets/merged", "--expect", "2"]) == 2  # committed: not overwritten
    assert "already holds a committed dataset" in capsys.readouterr().err


@pytest.mark.slow
def test_the_service_publishes_finished_datasets_to_a_bucket(s3, tmp_path, sample_rows):
    """PF_SERVICE_PUBLISH_URI: a finished dataset is uploaded (manifest last), its shards_path is the URI, and a
    trainer on another machine reads it from there (nothing shared but the bucket)."""
    from pf_trl.data.service_client import wait_for_dataset
    from pf_trl.data.shards import load_shards

    from test_service_support import Server, wait_state, write_rows

    root = tmp_path / "data"
    root.mkdir()
    write_rows(root / "rows.jsonl", sample_rows[:30])
    server = Server(tmp_path / "service", [root], env={**s3.env(), "PF_SERVICE_PUBLISH_URI": "s3://pfdata/published/"})
    server.start()
    try:
        with server.client() as client:
            r = client.post("/v1/datasets", json={"source": {"path": "rows.jsonl"}})
            assert r.status_code in (200, 202), r.text
            status = wait_state(client, r.json()["id"])
        assert status["state"] == "succeeded", status
        dataset_id = status["id"]
        assert status["shards_path"] == f"s3://pfdata/published/{dataset_id}"
        local = tmp_path / "service" / "datasets" / dataset_id
        remote = json.loads(s3.filesystem().cat(f"pfdata/published/{dataset_id}/pf_manifest.json"))
        assert remote["checksums"] == json.loads((local / "pf_manifest.json").read_text())["checksums"]
        # a trainer elsewhere: its own cache, the bucket through the AWS environment
        env = {**s3.env(), "PF_TRL_CACHE": str(tmp_path / "trainer")}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            from pf_trl.storage.filesystem import forget_filesystems

            forget_filesystems()
            fetched = wait_for_dataset(server.url, dataset_id, timeout_s=30, progress=False)
            assert str(fetched).startswith(str(tmp_path / "trainer"))
            assert list(load_shards(fetched)["input_ids"]) == list(load_shards(local)["input_ids"])
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            forget_filesystems()
    finally:
        server.stop()


def _forward_later(listen_port: int, target_port: int, delay_s: float) -> None:
    """After ``delay_s``, accept on ``listen_port`` and relay each connection to ``target_port`` (an endpoint that
    comes back: before that, connections are refused)."""
    import socket
    import threading
    import time

    def pipe(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve():
        time.sleep(delay_s)
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", listen_port))
        server.listen(16)
        server.settimeout(30)
        try:
            while True:
                client, _ = server.accept()
                upstream = socket.create_connection(("127.0.0.1", target_port))
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=pipe, args=(a, b), daemon=True).start()
        except OSError:
            server.close()

    threading.Thread(target=serve, daemon=True).start()


def test_transient_errors_are_retried_with_bounded_backoff(bucket_env, monkeypatch):
    """An endpoint that refuses connections for ~2 s, then answers: the read succeeds after retries (logged), while
    an endpoint that never answers fails in bounded time (test_bucket_training)."""
    import socket
    import time

    from pf_trl.storage import filesystem
    from pf_trl.storage.filesystem import read_bytes

    bucket_env.filesystem().pipe("pfdata/retry/x.txt", b"payload")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    filesystem.forget_filesystems()
    _forward_later(port, bucket_env.port, delay_s=2.0)
    started = time.monotonic()
    assert read_bytes("s3://pfdata/retry/x.txt") == b"payload"  # refused for 2 s: only pf-trl's retries get here
    assert time.monotonic() - started >= 1.5


@pytest.mark.slow
def test_a_data_config_names_bucket_sources_and_writes_to_a_bucket(bucket_env, committed, sample_rows, tmp_path):
    """--data_config with s3:// data paths (a data file and a committed dataset), mixed into a bucket prefix."""
    from pf_trl.cli.pretokenize import main
    from pf_trl.data.remote import local_path
    from pf_trl.data.shards import load_shards

    bucket_env.filesystem().pipe("pfdata/src/extra.jsonl",
                                 "".join(json.dumps(r) + "\n" for r in sample_rows[:20]).encode())
    config = tmp_path / "mix.yaml"
    config.write_text("datasets:\n"
                      "  - name: extra\n    sampling: 0.5\n    data_paths: [s3://pfdata/src/extra.jsonl]\n"
                      f"  - name: sample\n    sampling: 0.5\n    data_paths: [{committed}]\n")
    assert main(["--data_config", str(config), "s3://pfdata/datasets/mixed", "--no_progress"]) == 0
    mixed = load_shards(local_path("s3://pfdata/datasets/mixed"))
    assert [s["name"] for s in mixed.pf_manifest["sources"]] == ["extra", "sample"]
