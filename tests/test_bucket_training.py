"""The test of record for object storage: two simulated nodes with separate local disks (their own PF_TRL_CACHE and
working folder) and nothing shared but a bucket on a real S3 server (SeaweedFS, tests/s3_server.py).

A dataset is pretokenized from a bucket source into the bucket; ``pf-trl train`` reads it and writes its checkpoints
and final model into the bucket; a run killed (SIGKILL, its whole process tree) after a checkpoint is restarted with
the same command on the other node, whose disk is empty, and ends with the losses of an uninterrupted run. Wrong
credentials, a dead endpoint, a corrupted shard and a missing manifest are each refused in one line (exit 2).

The run killed and the run resumed are processes of their own (``pf-trl`` started as a pod starts it); the
pretokenize, the uninterrupted reference and the refusals run in this process (tests/in_process.py: the console
script's entry with the node's own environment and cache), which spares an interpreter start each (~4 CPU-s)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from in_process import run_cli
from s3_server import s3_server_or_skip

pytestmark = pytest.mark.slow

PF_TRL = str(Path(sys.executable).parent / "pf-trl")
TINY = "num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,num_key_value_heads=1"
MAX_STEPS, SAVE_STEPS = 6, 2
DATA = "s3://pfruns/datasets/d"
WRONG_SECRET = "not-the-secret-5f3a"


def _argv(output_dir: str, data: str = DATA) -> list[str]:
    return [PF_TRL, "train", "--model_name_or_path", "pf-trl/tiny-llama", "--model_overrides", TINY,
            "--training_data_path", data, "--output_dir", output_dir, "--resume_from_checkpoint", "auto",
            "--max_steps", str(MAX_STEPS), "--save_steps", str(SAVE_STEPS), "--save_total_limit", "2",
            "--logging_steps", "1", "--use_cpu", "True", "--per_device_train_batch_size", "4",
            "--learning_rate", "1e-3", "--seed", "0", "--dataloader_num_workers", "0", "--disable_tqdm", "True"]


class Node:
    """A machine of its own: a local disk (cache + working folder); the bucket through the AWS environment."""

    def __init__(self, root: Path, s3, **env: str):
        self.root = root
        (root / "work").mkdir(parents=True)
        self.env = {**os.environ, **s3.env(), "PF_TRL_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **env}

    def run(self, argv: list[str]) -> subprocess.CompletedProcess:
        """The command in this process, with this node's environment and working folder."""
        assert argv[0] == PF_TRL
        return run_cli(argv[1:], self.env, self.root / "work")

    def start(self, argv: list[str]) -> subprocess.Popen:
        with open(self.root / "train.log", "w") as log:
            proc = subprocess.Popen(argv, env=self.env, cwd=self.root / "work", stdout=log, stderr=subprocess.STDOUT)
        proc.node = self
        return proc

    def log(self) -> str:
        return (self.root / "train.log").read_text()


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL a pod: the process and every process under it, frozen first."""
    tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in tree:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    proc.wait()


def _losses(fs, run: str) -> list[float]:
    state = json.loads(fs.cat(f"pfruns/runs/{run}/checkpoint-{MAX_STEPS}/trainer_state.json"))
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def _refused(done: subprocess.CompletedProcess) -> str:
    """The refusal's one line (exit 2: a user error, never retried)."""
    said = done.stdout + done.stderr
    assert done.returncode == 2, said[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("pf-trl train: error: "), said[-3000:]
    assert WRONG_SECRET not in line  # no secret printed
    return line


def _dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    return port


def test_two_nodes_share_only_a_bucket(tmp_path, sample_path):
    s3 = s3_server_or_skip(tmp_path / "s3")
    try:
        _two_nodes(s3, tmp_path)
    finally:
        s3.stop()


def _two_nodes(s3, tmp_path):
    s3.make_bucket("pfruns")
    fs = s3.filesystem()
    rows = (Path(__file__).resolve().parents[1] / "pf_trl/data/samples/sharegpt_sample.jsonl").read_text().splitlines()
    fs.pipe("pfruns/src/train.jsonl", ("\n".join(rows[:200]) + "\n").encode())
    writer, a, b, ref = (Node(tmp_path / n, s3) for n in ("writer", "node-a", "node-b", "node-ref"))
    done = writer.run([PF_TRL, "pretokenize", "s3://pfruns/src/train.jsonl", DATA, "--max_seq_len", "256",
                       "--no_progress"])
    assert done.returncode == 0, done.stderr[-3000:]

    # the run to kill (node A); the uninterrupted run (node "ref") comes later, beside the resumed one
    victim = a.start(_argv("s3://pfruns/runs/job"))
    deadline = time.time() + 300
    # node A: killed (SIGKILL) once two checkpoints are committed in the bucket
    while not fs.exists(f"pfruns/runs/job/checkpoint-{2 * SAVE_STEPS}/pf_trl_checkpoint_complete.json"):
        assert victim.poll() is None and time.time() < deadline, a.log()[-3000:]
        time.sleep(0.05)
    _kill(victim)
    assert not fs.exists("pfruns/runs/job/train_results.json"), "killed too late: the run had finished"
    # the newest checkpoint as a pod killed during its upload leaves it: files there, no marker
    markers = sorted(p for p in fs.find("pfruns/runs/job") if p.endswith("pf_trl_checkpoint_complete.json"))
    newest = max(markers, key=lambda p: int(p.split("/checkpoint-")[1].split("/")[0]))
    fs.rm(newest)
    cut_short = newest.split("/")[-2]

    # what the refusals read: a copy of the dataset with one byte of its Arrow file changed, one without manifest
    manifest = json.loads(fs.cat("pfruns/datasets/d/pf_manifest.json"))
    writer_dir = f"pfruns/datasets/d/{manifest['storage_files_prefix']}"
    for name in manifest["checksums"]["files"]:
        data = bytearray(fs.cat(f"{writer_dir}/{name}"))
        if name.endswith(".arrow"):
            data[len(data) // 2] ^= 0xFF
        fs.pipe(f"pfruns/datasets/corrupt/{manifest['storage_files_prefix']}/{name}", bytes(data))
        fs.pipe(f"pfruns/datasets/uncommitted/{manifest['storage_files_prefix']}/{name}", bytes(data))
    fs.pipe("pfruns/datasets/corrupt/pf_manifest.json", json.dumps(manifest).encode())

    # node B, empty disk, same command: resumes from the latest complete checkpoint; the refusals meanwhile
    assert not (b.root / "cache").exists()
    resumed = b.start(_argv("s3://pfruns/runs/job"))
    started = time.time()
    refusals = {
        "wrong key": Node(tmp_path / "wrong-key", s3, AWS_SECRET_ACCESS_KEY=WRONG_SECRET).run(_argv("s3://pfruns/runs/x")),
        "dead endpoint": Node(tmp_path / "dead", s3, AWS_ENDPOINT_URL=f"http://127.0.0.1:{_dead_port()}").run(
            _argv("s3://pfruns/runs/x")),
        "corrupt": Node(tmp_path / "corrupt", s3).run(_argv("s3://pfruns/runs/x", "s3://pfruns/datasets/corrupt")),
        "no manifest": Node(tmp_path / "no-manifest", s3).run(
            _argv("s3://pfruns/runs/x", "s3://pfruns/datasets/uncommitted")),
    }
    lines = {what: _refused(done) for what, done in refusals.items()}
    # bounded, not retried without end: the retry schedule (pf-trl's 4 tries with backoff capped at 8 s, botocore's 3
    # attempts) ends a dead endpoint within ~30 s; the rest is four refusals beside a training on 2 cores
    assert time.time() - started < 180
    assert DATA in lines["wrong key"] and "access denied" in lines["wrong key"]
    assert "credentials from the environment (AWS_ACCESS_KEY_ID" in lines["wrong key"]
    assert DATA in lines["dead endpoint"] and "unreachable" in lines["dead endpoint"]
    assert "s3://pfruns/datasets/corrupt: shard file" in lines["corrupt"]
    assert "does not match its xxh3_128 checksum" in lines["corrupt"]
    assert "s3://pfruns/datasets/uncommitted has no pf_manifest.json" in lines["no manifest"]
    assert not fs.find("pfruns/runs/x")  # nothing written

    reference_run = ref.run(_argv("s3://pfruns/runs/ref"))  # meanwhile node B trains in its own process
    said_by_ref = reference_run.stdout + reference_run.stderr
    assert reference_run.returncode == 0, said_by_ref[-3000:]
    top = {p[len("pfruns/runs/ref/"):].split("/")[0] for p in fs.find("pfruns/runs/ref")}  # objects, not folders
    assert {"model.safetensors", "config.json", "train_results.json", "tokenizer.json"} <= top
    assert {t for t in top if t.startswith("checkpoint-")} == {"checkpoint-4", "checkpoint-6"}  # save_total_limit 2
    assert "pf-trl: model saved to s3://pfruns/runs/ref" in said_by_ref
    (staged,) = (ref.root / "cache" / "staging").glob("output-*")
    assert [p.name for p in staged.glob("checkpoint-*")] == [f"checkpoint-{MAX_STEPS}"]  # the node keeps the newest
    reference = _losses(fs, "ref")
    assert len(reference) == MAX_STEPS
    # trained while its files arrived (read-ahead fills the entry file by file), not after a whole download
    assert list((ref.root / "cache" / "remote").glob("*/.readahead")), "the run did not read ahead"

    assert resumed.wait(300) == 0, b.log()[-3000:]
    said = b.log()
    assert f"s3://pfruns/runs/job/{cut_short} is not complete" in said
    assert "resuming from s3://pfruns/runs/job/checkpoint-" in said
    np.testing.assert_allclose(_losses(fs, "job"), reference, rtol=1e-5, atol=1e-6)
