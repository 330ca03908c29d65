"""``gs://`` against a real Google Cloud Storage API server (gcp-storage-emulator, tests/gcs_server.py) on 127.0.0.1,
reached the way a job reaches one: ``STORAGE_EMULATOR_HOST``, read by gcsfs.

One run of the commands users run, shared by the checks: ``pf-trl pretokenize gs://.../train.jsonl gs://.../d`` and
``pf-trl train`` from that dataset with checkpoints into ``gs://``, through a relay (tests/s3_relay.py) answering a
share of the requests with GCS's own ``503 backendError``; the run's checkpoint-4 marker is then removed (a pod killed
during that upload) and the same command on another node, with an empty cache, resumes from checkpoint-2. The
losses are those of the same commands on a local copy, and every refused request was sent again. A burst of 503s
longer than gcsfs's own 6 tries of a request is survived by pf-trl's retry of the operation, one warning line.

The commands run in this process (tests/in_process.py: the console script's entry with a node's own environment and
cache): what is checked is what they send and what they say, not a process of their own.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
from gcs_server import BACKEND_ERROR, gcs_server_or_skip
from in_process import run_cli
from s3_relay import S3Relay

pytestmark = pytest.mark.slow

TINY = "num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,num_key_value_heads=1"
BUCKET = "pfgcs"
MARKER = "pf_trl_checkpoint_complete.json"
THROTTLE = 0.06  # of the requests answered 503: each costs gcsfs a backoff of 1-2 s (its schedule is fixed)


def _train_argv(data: str, output: str) -> list[str]:
    return ["train", "--model_name_or_path", "pf-trl/tiny-llama", "--model_overrides", TINY, "--training_data_path",
            data, "--output_dir", output, "--resume_from_checkpoint", "auto", "--max_steps", "4", "--save_steps", "2",
            "--logging_steps", "1", "--use_cpu", "True", "--per_device_train_batch_size", "4", "--learning_rate",
            "1e-3", "--seed", "0", "--dataloader_num_workers", "0", "--disable_tqdm", "True", "--report_to", "none"]


class Node:
    """A machine of its own: a local disk (cache + working folder) and ``extra`` environment."""

    def __init__(self, root: Path, **extra: str):
        (root / "work").mkdir(parents=True)
        self.root = root
        env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
        self.env = {**env, "PF_TRL_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1", **extra}

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        done = run_cli(list(argv), self.env, self.root / "work")
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        return done


def _losses(state: dict) -> list[float]:
    return [h["loss"] for h in state["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    server = gcs_server_or_skip(tmp_path_factory.mktemp("gcs"))
    server.make_bucket(BUCKET)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def runs(gcs, tmp_path_factory):
    """The local reference, then the gs:// run through a throttling relay and its resume on another node."""
    tmp = tmp_path_factory.mktemp("runs")
    rows = (Path(__file__).resolve().parents[1] / "pf_trl/data/samples/sharegpt_sample.jsonl").read_text()
    source = ("\n".join(rows.splitlines()[:64]) + "\n").encode()
    (tmp / "train.jsonl").write_bytes(source)
    gcs.put(BUCKET, "src/train.jsonl", source)

    local = Node(tmp / "local")
    local.run("pretokenize", str(tmp / "train.jsonl"), str(tmp / "local-d"), "--max_seq_len", "128", "--no_progress")
    local.run(*_train_argv(str(tmp / "local-d"), str(tmp / "local-run")))
    reference = json.loads((tmp / "local-run" / "checkpoint-4" / "trainer_state.json").read_text())

    relay = S3Relay(gcs.port, throttle=THROTTLE, seed=0, refusal=BACKEND_ERROR)
    try:
        writer = Node(tmp / "writer", **gcs.env(relay.endpoint))
        said = writer.run("pretokenize", f"gs://{BUCKET}/src/train.jsonl", f"gs://{BUCKET}/datasets/d",
                          "--max_seq_len", "128", "--no_progress").stderr
        trained = writer.run(*_train_argv(f"gs://{BUCKET}/datasets/d", f"gs://{BUCKET}/runs/a"))
        first = json.loads(gcs.get(BUCKET, "runs/a/checkpoint-4/trainer_state.json"))
        objects = gcs.names(BUCKET)
        gcs.delete(BUCKET, f"runs/a/checkpoint-4/{MARKER}")  # as a pod killed during that upload leaves it
        resumed = Node(tmp / "other", **gcs.env(relay.endpoint)).run(
            *_train_argv(f"gs://{BUCKET}/datasets/d", f"gs://{BUCKET}/runs/a"))
    finally:
        relay.stop()
    return {"reference": reference, "first": first, "objects": objects,
            "resumed": json.loads(gcs.get(BUCKET, "runs/a/checkpoint-4/trainer_state.json")),
            "said": said + trained.stdout + trained.stderr, "resumed_said": resumed.stdout + resumed.stderr,
            "relay": relay, "tmp": tmp}


def test_a_dataset_pretokenized_into_gs_trains_to_the_losses_of_the_local_copy(runs):
    reference = _losses(runs["reference"])
    assert len(reference) == 4
    # the same rows, the same ops in the same order (the node's copy of the bucket's files): to the bit
    assert _losses(runs["first"]) == reference


def test_checkpoints_and_the_model_are_committed_in_gs_by_their_markers(runs, gcs):
    objects = runs["objects"]
    assert "datasets/d/pf_manifest.json" in objects
    manifest = json.loads(gcs.get(BUCKET, "datasets/d/pf_manifest.json"))
    assert {f"datasets/d/{manifest['storage_files_prefix']}/{name}" for name in manifest["checksums"]["files"]} \
        <= set(objects)
    for step in (2, 4):
        marker = json.loads(gcs.get(BUCKET, f"runs/a/checkpoint-{step}/{MARKER}"))
        listed = set(marker["files"])
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= listed, sorted(listed)
        assert {f"runs/a/checkpoint-{step}/{name}" for name in listed} <= set(objects)
    assert {"runs/a/model.safetensors", "runs/a/config.json"} <= set(objects)
    assert f"pf-trl: model saved to gs://{BUCKET}/runs/a" in runs["said"]


def test_a_run_resumed_on_another_node_from_gs_ends_with_the_uninterrupted_losses(runs):
    said = runs["resumed_said"]
    assert f"gs://{BUCKET}/runs/a/checkpoint-4 is not complete" in said, said[-3000:]
    assert f"resuming from gs://{BUCKET}/runs/a/checkpoint-2" in said, said[-3000:]
    assert _losses(runs["resumed"]) == _losses(runs["reference"])


def test_gcs_s_503s_were_answered_and_each_refused_request_sent_again(runs):
    relay = runs["relay"]
    assert relay.throttled >= 5, relay.throttled  # the relay did refuse: the runs above proved something
    forwarded = set(relay.log)
    assert all(request in forwarded for request in relay.refused), sorted(set(relay.refused) - forwarded)
    said = runs["said"] + runs["resumed_said"]
    # gcsfs's retries, one line each (it logs them at DEBUG only): one for each refusal gcsfs read (a read-ahead
    # request cancelled when its command ends may be refused unread; the burst test below counts them exactly)
    retried = "pf-trl: gcs: a request answered Backend Error, 503; gcsfs tries it again (up to 6 tries)"
    assert relay.throttled - 2 <= said.count(retried) <= relay.throttled, said[-3000:]
    # pf-trl talks to the emulator with gcsfs's JSON-API filesystem: its default one asks the Storage Control gRPC
    # API for each bucket's layout, which no emulator serves, and warns on every operation
    assert "Could not determine bucket type" not in said and "Traceback" not in said


def test_a_burst_longer_than_gcsfs_s_retries_is_retried_by_pf_trl(gcs, monkeypatch, caplog):
    """One object answered 503 six times in a row: gcsfs's 6 tries of the request all fail (~33 s of its own
    backoff), it raises its ``HttpError`` (code 503), and pf-trl recognises it and tries the read again."""
    from pf_trl.storage import filesystem

    gcs.put(BUCKET, "burst/probe.json", b'{"ok": true}')
    relay = S3Relay(gcs.port, throttle_first=6, refusal=BACKEND_ERROR,
                    throttled_paths=lambda method, path: "probe.json" in path)
    try:
        for name, value in gcs.env(relay.endpoint).items():
            monkeypatch.setenv(name, value)
        filesystem.forget_filesystems()
        with caplog.at_level(logging.WARNING, logger="pf_trl.storage"):
            assert filesystem.read_bytes(f"gs://{BUCKET}/burst/probe.json") == b'{"ok": true}'
    finally:
        relay.stop()
        filesystem.forget_filesystems()
    assert relay.throttled == 6
    retried = [r.getMessage() for r in caplog.records if r.name == "pf_trl.storage"]
    assert len(retried) == 1 and retried[0].startswith(f"pf-trl: gs://{BUCKET}/burst/probe.json: reading it: "
                                                       "Backend Error, 503; retry 1 of 3 in "), retried
    by_gcsfs = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "gcsfs"]
    # gcsfs's 5 retries of the request, one line each; its giving up (an ERROR with a traceback) not said: pf-trl is
    # about to try again, or to fail in one line
    assert by_gcsfs == [("WARNING", "pf-trl: gcs: a request answered Backend Error, 503; gcsfs tries it again (up to "
                                    "6 tries)")] * 5, by_gcsfs


@pytest.mark.extended
def test_503s_beyond_every_retry_end_the_command_in_one_line(gcs, tmp_path):
    """Every request answered 503: gcsfs's 6 tries of each request (~33 s of its fixed backoff) and pf-trl's 4 tries
    of the operation are spent (~2.5 min, most of it waiting), then ``pf-trl pretokenize`` fails in one line, exit 2.

    Extended lane: the parts are proven in the main lane, faster: the one line after the last try
    (tests/test_bucket_throttling.py::test_retries_exhausted_end_in_one_line, on S3), and gcsfs's real 503 recognised
    as throttling and retried by pf-trl (test_a_burst_longer_than_gcsfs_s_retries_is_retried_by_pf_trl)."""
    gcs.put(BUCKET, "src/never.jsonl", b'{"text": "x"}\n')
    relay = S3Relay(gcs.port, throttle=1.0, refusal=BACKEND_ERROR)
    try:
        done = run_cli(["pretokenize", f"gs://{BUCKET}/src/never.jsonl", f"gs://{BUCKET}/datasets/never",
                        "--max_seq_len", "128", "--no_progress"],
                       {**os.environ, **gcs.env(relay.endpoint), "PF_TRL_CACHE": str(tmp_path / "cache")}, tmp_path)
    finally:
        relay.stop()
    assert done.returncode == 2, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"pf-trl pretokenize: error: source gs://{BUCKET}/src/never.jsonl: the storage server kept "
                           "refusing with throttling or server errors after 4 tries (Backend Error, 503)"), line
    assert "no credentials, the emulator at STORAGE_EMULATOR_HOST=" in line and "AWS_MAX_ATTEMPTS" not in line
    assert done.stderr.count("retry 3 of 3") == 1
    assert "Traceback" not in done.stderr and "out of retries" not in done.stderr
    assert relay.throttled >= 24  # gcsfs's 6 tries of the first request, 4 times
