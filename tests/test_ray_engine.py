"""`pf-trl pretokenize --engine ray` against a real local Ray cluster this module starts once (2 CPUs, a small object
store, its own short temp dir; stopped with ray.shutdown(), never `ray stop`) and a real S3 server (SeaweedFS,
tests/s3_server.py) its workers reach through the AWS environment, as a cluster's pods do:

- a folder DEST: the rows of the single-process engine in source order with the same identity; refusals as the
  default engine's;
- a bucket DEST, in one run: the job (a CLI process of its own joining through RAY_ADDRESS) killed once parts are
  committed (its workers frozen first), submitted again (resumed from its committed parts, an uncommitted attempt
  neither listed nor kept), a worker SIGKILLed mid-part in the resumed run (retried by Ray, every row once), the
  result trained on from the bucket through the read-ahead to the losses of the single-process dataset.

Run as its own suite: `pytest -m ray tests/test_ray_engine.py` (scripts/test.sh installs pf-trl[ray] for it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from s3_server import s3_server_or_skip

from conftest import write_jsonl

ray = pytest.importorskip("ray", reason="the ray suite needs pf-trl[ray]")

pytestmark = pytest.mark.ray

FLAGS = ["--max_seq_len", "64", "--truncation", "drop", "--no_progress"]
TINY = "num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2"
ROWS, PER_PART = 160, 20  # 8 parts
BUCKET = "pfray"


def _rows(n: int) -> list[dict]:
    # ~10 to ~90 tokens; the longer ones dropped at 64, so that parts keep different numbers of rows
    return [{"prompt": f"### Instruction:\nCount to {i}.\n\n### Response:\n",
             "completion": f"{i}, " * (2 + 3 * (i % 11))} for i in range(n)]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = s3_server_or_skip(tmp_path_factory.mktemp("s3"))
    server.make_bucket(BUCKET)
    yield server
    server.stop()


def _node_cache(path: Path) -> str:
    """A node cache of its own for remote data and staging, sharing this machine's converted tokenizers (converting
    the embedded one again costs seconds and shows nothing here)."""
    from pf_trl.data.tokenizer import cache_root

    path.mkdir(parents=True, exist_ok=True)
    (cache_root() / "tokenizers").mkdir(parents=True, exist_ok=True)
    (path / "tokenizers").symlink_to(cache_root() / "tokenizers")
    return str(path)


# What this suite does not look at, off in every process of the cluster and in the CLI's driver (they inherit the
# environment): usage reports, the metrics every Ray process exports, Ray Data's progress bars. Periodic work, so it
# counts when the run is stretched by the other suites beside it (the folder run on a loaded machine: 38.8 -> 33.5
# CPU-s, medians of two); on a quiet machine it is within noise
LEAN_RAY = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_enable_metrics_collection": "0", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    """A local Ray of 2 CPUs started in this process, with the S3 environment and a node cache of its own (its
    workers inherit them); its GCS address is the RAY_ADDRESS of the CLI subprocess."""
    from pf_trl.storage import filesystem

    try:
        s3_env = request.getfixturevalue("s3").env()
    except pytest.skip.Exception:  # PF_TRL_SKIP_S3=1: no S3 server here; the folder test still runs
        s3_env = {}
    env = {**s3_env, "PF_TRL_CACHE": _node_cache(tmp_path_factory.mktemp("cluster") / "node"), **LEAN_RAY}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    filesystem.forget_filesystems()
    temp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's Unix sockets live under it
    context = ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False, log_to_driver=False,
                       _temp_dir=temp, configure_logging=False, _system_config={"enable_metrics_collection": False})
    try:
        yield context
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        filesystem.forget_filesystems()


@pytest.fixture(scope="module")
def source(tmp_path_factory, tokenizer):
    """A 160-row source and what the single-process engine writes from it."""
    from pf_trl.cli.main import main

    root = tmp_path_factory.mktemp("ray-src")
    src = write_jsonl(root / "rows.jsonl", _rows(ROWS))
    assert main(["pretokenize", str(src), str(root / "local"), *FLAGS]) == 0
    return root


def _same_as_local(dest: Path, local: Path) -> dict:
    from pf_trl.data.identity import identity_of_manifest
    from pf_trl.data.shards import load_shards

    ray_ds, one = load_shards(dest), load_shards(local)
    assert ray_ds.num_rows == one.num_rows
    assert ray_ds["input_ids"] == one["input_ids"] and ray_ds["labels"] == one["labels"]
    m, w = ray_ds.pf_manifest, one.pf_manifest
    assert m["counts"] == w["counts"] and m["lengths"] == w["lengths"]
    assert identity_of_manifest(m) | {"where": None} == identity_of_manifest(w) | {"where": None}
    return m


def _part_rows(manifest: dict) -> list[list[int]]:
    return [p["source_rows"] for p in manifest["parts"]]


EVERY_PART = [[a, a + PER_PART] for a in range(0, ROWS, PER_PART)]  # source order, every row once


def _ray_workers_of_this_cluster() -> list[int]:
    """The pids of this module's Ray workers running PartWriter (descendants of this process only)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            pid, parent = int(entry.name), int(entry.name)
            if "PartWriter" not in cmdline:
                continue
            for _ in range(8):  # worker <- raylet <- this process
                parent = int((Path("/proc") / str(parent) / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if parent == me:
                    found.append(pid)
                    break
                if parent <= 1:
                    break
        except (OSError, ValueError, IndexError):
            continue
    return found


def _run_killing_the_workers_mid_part(argv: list[str], attempts: Path) -> tuple[int, list[int]]:
    """``pf-trl ARGV`` in this process (a thread), this cluster's PartWriter workers SIGKILLed as soon as a part is
    being written (an attempt folder in ``attempts``); ``(exit status, the pids killed)``. Ray restarts the workers
    and retries their parts."""
    from pf_trl.cli.main import main

    result: dict = {}

    def run():
        try:
            result["rc"] = main(argv)
        except BaseException as exc:  # asserted below
            result["rc"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    killed: list[int] = []
    while not killed and thread.is_alive():
        if list(attempts.glob(".part-*.tmp-*")):  # a worker is writing a part right now
            for pid in _ray_workers_of_this_cluster():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        thread.join(0.005)  # waits on the run itself between looks
    thread.join(timeout=300)
    assert killed, "no worker was caught mid-part"
    assert not thread.is_alive(), "the run did not end"
    for pid in killed:  # gone, not left running beside their replacements
        assert not Path(f"/proc/{pid}").exists() or "PartWriter" not in Path(f"/proc/{pid}/cmdline").read_text()
    return result.get("rc"), killed


@pytest.mark.slow
def test_a_folder_dest_holds_the_rows_of_one_process(cluster, source, tmp_path, capsys):
    from pf_trl.cli.main import main

    dest = tmp_path / "ray"
    assert main(["pretokenize", str(source / "rows.jsonl"), str(dest), *FLAGS, "--engine", "ray",
                 "--rows_per_part", str(PER_PART)]) == 0
    summary = json.loads(capsys.readouterr().out)
    m = _same_as_local(dest, source / "local")
    assert summary["counts"] == m["counts"] and m["counts"]["dropped_too_long"] > 0
    assert m["engine"] == {"name": "ray", "workers": 2, "rows_per_part": PER_PART}
    assert _part_rows(m) == EVERY_PART and [p["name"] for p in m["parts"]] == sorted(
        p.name for p in dest.iterdir() if p.name.startswith("part-"))
    assert not [p.name for p in dest.iterdir() if p.name.startswith(".")]  # no plan, work dir or attempt left
    # a committed dataset is not written over without --overwrite
    assert main(["pretokenize", str(source / "rows.jsonl"), str(dest), *FLAGS, "--engine", "ray"]) == 2
    assert "already exists" in capsys.readouterr().err
    # a source the default engine refuses is refused the same way, in one line, before any Ray task; nothing written
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "no known format"}])
    assert main(["pretokenize", str(bad), str(tmp_path / "bad"), "--engine", "ray"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pf-trl pretokenize: error:") and "\n" not in err and not (tmp_path / "bad").exists()
    assert main(["pretokenize", str(bad), str(tmp_path / "bad-local")]) == 2
    assert capsys.readouterr().err.strip().split("error:")[1] == err.split("error:")[1]


def _wait_until(condition, what: str, timeout_s: float = 240.0, every_s: float = 0.02):
    """Poll ``condition()`` (a bucket has no change notification) every ``every_s`` until it holds; its last value."""
    import time

    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)
    return value


@pytest.mark.slow
def test_a_bucket_run_interrupted_resumes_from_committed_parts_loses_no_row_and_trains(cluster, source, s3, tmp_path,
                                                                                      monkeypatch, capsys):
    """`pf-trl pretokenize ... s3://... --engine ray` as a job of its own on the cluster (RAY_ADDRESS), killed once
    parts are committed (its workers frozen first, so that no part is committed meanwhile), then submitted again: the
    committed parts kept, an uncommitted attempt neither listed nor kept; a worker SIGKILLed mid-part in the resumed
    run is retried; the result trains from the bucket (read-ahead) to the losses of the single-process dataset."""
    from pf_trl import PretokenizeConfig, pretokenize
    from pf_trl.cli.main import main
    from pf_trl.data.pretokenize import PretokenizeError
    from pf_trl.data.remote import local_path
    from pf_trl.storage import StorageError

    uri, prefix, fs = f"s3://{BUCKET}/ds", f"{BUCKET}/ds", s3.filesystem()
    argv = ["pretokenize", str(source / "rows.jsonl"), uri, *FLAGS, "--engine", "ray", "--rows_per_part",
            str(PER_PART), "--ray_workers", "1"]  # one actor (re)started
    with_progress = [a for a in argv if a != "--no_progress"]  # the first submission shows Ray Data's progress
    proc = subprocess.Popen([sys.executable, "-m", "pf_trl.cli.main", *with_progress],
                            env={**os.environ, "RAY_ADDRESS": cluster.address_info["gcs_address"]},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    def committed(at_least: int = 2) -> dict[str, str]:  # {part: writer} of the committed attempts
        found = fs.glob(f"{prefix}/w-*/part-*/pf_manifest.json")
        return {p.split("/")[-2]: p.split("/")[-3] for p in found} \
            if len(found) >= at_least or proc.poll() is not None else {}

    # the job's start (a process importing Ray and pf-trl, an actor) takes seconds: a bucket listing every 0.2 s until
    # its first part, every 20 ms from there (a part takes longer than that), not 50 listings a second throughout
    _wait_until(lambda: committed(1), "a committed part", every_s=0.2)
    _wait_until(committed, "two committed parts")
    workers = _ray_workers_of_this_cluster()
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)  # frozen: no part is committed from here on
    assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
    os.killpg(proc.pid, signal.SIGKILL)  # the job's driver, its process group only
    first_err = proc.communicate()[1].decode()
    assert "Starting execution of Dataset" in first_err  # Ray Data's execution lines, without --no_progress
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    done = committed()
    plan = json.loads(fs.cat(f"{prefix}/pf_plan.json"))
    assert 2 <= len(done) < ROWS // PER_PART, "not interrupted mid-run"
    assert set(done.values()) == {plan["writer"]} and not fs.exists(f"{prefix}/pf_manifest.json")
    # not a dataset yet: a reader refuses the prefix
    with pytest.raises(StorageError, match="not a committed pf-trl dataset"):
        local_path(uri)
    # an attempt cut short (files, no manifest) at a part still to write: never listed, never kept
    todo = min(a for a in range(0, ROWS, PER_PART) if not any(n.startswith(f"part-{a:012d}-") for n in done))
    junk = f"{prefix}/{plan['writer']}/part-{todo:012d}-0badc0de"
    fs.pipe(f"{junk}/data-00000-of-00001.arrow", b"cut short")
    # other flags on the interrupted run: refused, nothing touched
    with pytest.raises(PretokenizeError, match="interrupted run of another source, tokenizer or flags"):
        pretokenize(source / "rows.jsonl", uri, PretokenizeConfig(max_seq_len=32, truncation="drop"), engine="ray",
                    rows_per_part=PER_PART)
    # submitted again (in this process: the same CLI, the same cluster), a worker SIGKILLed mid-part
    capsys.readouterr()
    rc, _ = _run_killing_the_workers_mid_part(argv, Path(os.environ["PF_TRL_CACHE"]) / "staging")
    assert rc == 0
    manifest = json.loads(fs.cat(f"{prefix}/pf_manifest.json"))
    # stdout is the summary alone: Ray's message about the dead worker went to stderr; --no_progress: none of Ray
    # Data's execution lines
    said = capsys.readouterr()
    assert json.loads(said.out)["counts"] == manifest["counts"]
    assert "Starting execution of Dataset" not in said.err and "Execution plan" not in said.err
    names = [p["name"] for p in manifest["parts"]]
    assert _part_rows(manifest) == EVERY_PART and manifest["storage_files_prefix"] == plan["writer"]
    assert set(done) <= set(names)  # the committed attempts are the parts: none written again
    attempts = {p.split("/")[3] for p in fs.find(f"{prefix}/{plan['writer']}") if p.count("/") > 3}
    assert attempts == set(names) and junk.rsplit("/", 1)[1] not in names  # nothing else kept: cut attempts removed
    assert not fs.exists(f"{prefix}/pf_plan.json")
    _same_as_local(local_path(uri), source / "local")
    # the trainer reads the parts from the bucket as they download (a node cache of its own): the losses of the
    # single-process dataset, bit for bit (same rows, same batches, same ops)
    monkeypatch.setenv("PF_TRL_CACHE", _node_cache(tmp_path / "trainer-node"))
    losses = {}
    for name, data in (("bucket", uri), ("local", str(source / "local"))):
        out = tmp_path / f"run-{name}"
        assert main(["train", "--model_name_or_path", "pf-trl/tiny-llama", "--model_overrides", TINY,
                     "--training_data_path", data, "--output_dir", str(out), "--max_seq_len", "64",
                     "--max_steps", "2", "--per_device_train_batch_size", "4", "--logging_steps", "1",
                     "--save_strategy", "steps", "--save_steps", "2", "--report_to", "none",
                     "--disable_tqdm", "True"]) == 0
        state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
        losses[name] = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses["bucket"]) == 2 and losses["bucket"] == losses["local"]
