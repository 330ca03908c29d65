"""`pf-trl pretokenize --engine ray` against a real local Ray cluster this module starts (2 CPUs, a small object
store, its own short temp dir; stopped with ray.shutdown(), never `ray stop`): the rows of the single-process engine
in source order with the same identity, trained to the same losses; a worker SIGKILLed mid-part (retried by Ray,
every row once); a run killed and submitted again (resumed from its committed parts).

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
import time
from pathlib import Path

import pytest

from conftest import write_jsonl

ray = pytest.importorskip("ray", reason="the ray suite needs pf-trl[ray]")

pytestmark = pytest.mark.ray

FLAGS = ["--max_seq_len", "64", "--truncation", "drop", "--no_progress"]
TINY = "num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2"


def _rows(n: int) -> list[dict]:
    # ~10 to ~90 tokens; the longer ones dropped at 64, so that parts keep different numbers of rows
    return [{"prompt": f"### Instruction:\nCount to {i}.\n\n### Response:\n",
             "completion": f"{i}, " * (2 + 3 * (i % 11))} for i in range(n)]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray of 2 CPUs started in this process; its GCS address is the RAY_ADDRESS of the CLI subprocesses."""
    temp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's Unix sockets live under it
    context = ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False, log_to_driver=False,
                       _temp_dir=temp, configure_logging=False)
    try:
        yield context.address_info["gcs_address"]
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def source(tmp_path_factory, tokenizer):
    """A 400-row source and what the single-process engine writes from it."""
    from pf_trl.cli.main import main

    root = tmp_path_factory.mktemp("ray-src")
    src = write_jsonl(root / "rows.jsonl", _rows(400))
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


def _part_rows(dest: Path) -> list[list[int]]:
    return [json.loads((dest / p["name"] / "pf_manifest.json").read_text())["part"]["source_rows"]
            for p in json.loads((dest / "pf_manifest.json").read_text())["parts"]]


@pytest.mark.slow
def test_ray_engine_writes_the_rows_of_one_process_and_trains(cluster, source, tmp_path, capsys):
    from pf_trl.cli.main import main

    dest = tmp_path / "ray"
    assert main(["pretokenize", str(source / "rows.jsonl"), str(dest), *FLAGS, "--engine", "ray",
                 "--rows_per_part", "70"]) == 0
    summary = json.loads(capsys.readouterr().out)
    m = _same_as_local(dest, source / "local")
    assert summary["counts"] == m["counts"] and m["counts"]["dropped_too_long"] > 0
    assert m["engine"]["name"] == "ray" and len(m["parts"]) == 6
    assert _part_rows(dest) == [[a, min(a + 70, 400)] for a in range(0, 400, 70)]  # source order, every row once
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
    # the trainer reads the parts as they are: the losses of the single-process dataset, bit for bit (same rows,
    # same batches, same ops)
    losses = {}
    for name, data in (("ray", dest), ("local", source / "local")):
        out = tmp_path / f"run-{name}"
        assert main(["train", "--model_name_or_path", "pf-trl/tiny-llama", "--model_overrides", TINY,
                     "--training_data_path", str(data), "--output_dir", str(out), "--max_seq_len", "64",
                     "--max_steps", "2", "--per_device_train_batch_size", "4", "--logging_steps", "1",
                     "--save_strategy", "steps", "--save_steps", "2", "--report_to", "none",
                     "--disable_tqdm", "True"]) == 0
        state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
        losses[name] = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses["ray"]) == 2 and losses["ray"] == losses["local"]


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


@pytest.mark.slow
def test_a_worker_killed_mid_part_is_retried_and_every_row_written_once(cluster, source, tmp_path):
    from pf_trl import PretokenizeConfig, pretokenize

    dest = tmp_path / "ray"
    config = PretokenizeConfig(max_seq_len=64, truncation="drop")
    result: dict = {}

    def run():
        try:
            result["manifest"] = pretokenize(source / "rows.jsonl", dest, config, engine="ray", rows_per_part=50)
        except BaseException as exc:  # asserted below
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    killed: list[int] = []
    deadline = time.time() + 240
    while not killed and thread.is_alive() and time.time() < deadline:
        if list(dest.glob(".part-*.tmp-*")):  # a part is being written right now
            for pid in _ray_workers_of_this_cluster():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.005)
    thread.join(timeout=300)
    assert killed, "no worker was caught mid-part"
    assert "error" not in result, result.get("error")
    _same_as_local(dest, source / "local")
    assert _part_rows(dest) == [[a, a + 50] for a in range(0, 400, 50)]
    for pid in killed:
        assert not Path(f"/proc/{pid}").exists() or "PartWriter" not in Path(f"/proc/{pid}/cmdline").read_text()


@pytest.mark.slow
def test_an_interrupted_run_resumes_from_its_committed_parts(cluster, source, tmp_path):
    """The CLI as a job on the cluster (a process of its own joining through RAY_ADDRESS), SIGKILLed once parts are
    committed, then submitted again: the committed parts are kept as they are, the rest written, the rows those of
    one process."""
    dest = tmp_path / "ray"
    cmd = [sys.executable, "-m", "pf_trl.cli.main", "pretokenize", str(source / "rows.jsonl"), str(dest), *FLAGS,
           "--engine", "ray", "--rows_per_part", "50"]
    env = {**os.environ, "RAY_ADDRESS": cluster, "PF_TRL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and len(list(dest.glob("part-*/pf_manifest.json"))) < 2:
        time.sleep(0.01)
    assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
    os.killpg(proc.pid, signal.SIGKILL)  # the job's driver, its process group only
    proc.communicate()
    committed = {p.parent.name: p.stat().st_mtime_ns for p in dest.glob("part-*/pf_manifest.json")}
    assert 2 <= len(committed) < 8, "not interrupted mid-run"
    assert not (dest / "pf_manifest.json").exists() and (dest / "pf_plan.json").exists()
    # other flags on the interrupted run: refused, nothing touched
    from pf_trl import PretokenizeConfig, pretokenize
    from pf_trl.data.pretokenize import PretokenizeError

    with pytest.raises(PretokenizeError, match="interrupted run of another source, tokenizer or flags"):
        pretokenize(source / "rows.jsonl", dest, PretokenizeConfig(max_seq_len=32, truncation="drop"), engine="ray",
                    rows_per_part=50)
    # submitted again (in this process: the same CLI, the same cluster)
    from pf_trl.cli.main import main

    assert main(cmd[3:]) == 0
    for name, mtime in committed.items():
        assert (dest / name / "pf_manifest.json").stat().st_mtime_ns == mtime, f"{name} was written again"
    _same_as_local(dest, source / "local")
