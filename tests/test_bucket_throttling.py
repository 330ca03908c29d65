"""Throttling survived (pf_trl/storage/retries.py, pf_trl/storage/filesystem.py): ``pf-trl pretokenize`` into a
bucket and ``pf-trl train`` with checkpoints into it, through a relay (tests/s3_relay.py) that answers 30% of the
requests ``503 SlowDown`` with S3's XML error body, give the dataset and the losses of the same commands run
straight against the server (SeaweedFS); with every request throttled and retries exhausted the command fails in one
line. The classifier is also checked on each backend's own exception types (s3fs, gcsfs, adlfs / azure-core).

The commands run in this process (tests/in_process.py: the console script's entry, a node's own environment and
cache): what is checked is what they send through the relay and what they say, not a process of their own."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from in_process import run_cli
from s3_relay import S3Relay
from s3_server import s3_server_or_skip

TINY = "num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,num_key_value_heads=1"
SOURCE = "s3://pfthr/src/train.jsonl"


def test_each_backend_s_throttling_and_server_errors_are_retried_and_the_rest_not():
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    from pf_trl.storage.retries import is_throttled, is_transient

    def s3_error(status: int, code: str, message: str) -> OSError:
        """What s3fs raises after its last try: botocore's ClientError translated into a Python exception."""
        err = ClientError({"Error": {"Code": code, "Message": message},
                           "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
        return translate_boto_error(err)

    slow_down = s3_error(503, "SlowDown", "Please reduce your request rate.")
    assert type(slow_down) is OSError and "SlowDown" not in str(slow_down)  # the shape the old classifier missed
    for status, code in ((503, "SlowDown"), (429, "TooManyRequests"), (500, "InternalError"),
                         (503, "ServiceUnavailable"), (502, "BadGateway"), (504, "GatewayTimeout")):
        assert is_transient(s3_error(status, code, "x")) and is_throttled(s3_error(status, code, "x")), code
    for status, code in ((403, "AccessDenied"), (404, "NoSuchKey"), (400, "InvalidRequest")):
        assert not is_transient(s3_error(status, code, "x")), code

    from gcsfs.retry import HttpError

    assert is_transient(HttpError({"code": 429, "message": "rateLimitExceeded"}))
    assert is_transient(HttpError({"code": 503, "message": "backend unavailable"}))
    assert not is_transient(HttpError({"code": 403, "message": "forbidden"}))

    from azure.core.exceptions import HttpResponseError, ResourceNotFoundError, ServiceRequestError

    busy = HttpResponseError(message="The server is busy.")
    busy.status_code = 503  # set by azure-core from the HTTP response it raises for
    assert is_transient(busy) and is_transient(ServiceRequestError("connection reset"))
    gone = ResourceNotFoundError(message="The specified blob does not exist.")
    gone.status_code = 404
    assert not is_transient(gone)


class Node:
    """A process environment of its own: a node cache, and the bucket reached at ``endpoint``."""

    def __init__(self, root: Path, s3, endpoint: str, **env: str):
        root.mkdir(parents=True)
        self.root = root
        self.env = {**os.environ, **s3.env(AWS_ENDPOINT_URL=endpoint), "PF_TRL_CACHE": str(root / "cache"),
                    "OMP_NUM_THREADS": "1", **env}

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        return run_cli(list(argv), self.env, self.root)


def _train_argv(data: str, output: str) -> list[str]:
    return ["train", "--model_name_or_path", "pf-trl/tiny-llama", "--model_overrides", TINY, "--training_data_path",
            data, "--output_dir", output, "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1",
            "--use_cpu", "True", "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--seed", "0",
            "--dataloader_num_workers", "0", "--disable_tqdm", "True", "--report_to", "none"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = s3_server_or_skip(tmp_path_factory.mktemp("s3"))
    server.make_bucket("pfthr")
    rows = (Path(__file__).resolve().parents[1] / "pf_trl/data/samples/sharegpt_sample.jsonl").read_text()
    server.filesystem().pipe(SOURCE[len("s3://"):], ("\n".join(rows.splitlines()[:64]) + "\n").encode())
    yield server
    server.stop()


@pytest.mark.slow
def test_a_run_with_30_percent_of_requests_throttled_gives_the_fault_free_results(s3, tmp_path, monkeypatch):
    from pf_trl.cli.pretokenize import main as pretokenize
    from pf_trl.cli.train import main as train
    from pf_trl.storage import filesystem

    # the fault-free reference, straight to the server (in this process: no second interpreter start)
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "clean-cache"))
    filesystem.forget_filesystems()
    assert pretokenize([SOURCE, "s3://pfthr/datasets/clean", "--max_seq_len", "128", "--no_progress"]) == 0
    monkeypatch.chdir(tmp_path)
    assert train(_train_argv("s3://pfthr/datasets/clean", "s3://pfthr/runs/clean")[1:]) == 0
    filesystem.forget_filesystems()

    # the same commands, as users run them, through a relay answering 30% of the requests 503 SlowDown
    relay = S3Relay(s3.port, throttle=0.3, seed=0)
    try:
        node = Node(tmp_path / "thr", s3, relay.endpoint)
        done = node.run("pretokenize", SOURCE, "s3://pfthr/datasets/thr", "--max_seq_len", "128", "--no_progress")
        assert done.returncode == 0, done.stderr[-3000:]
        log = done.stderr
        done = node.run(*_train_argv("s3://pfthr/datasets/thr", "s3://pfthr/runs/thr"))
        assert done.returncode == 0, done.stderr[-3000:]
        log += done.stdout + done.stderr
    finally:
        relay.stop()
    assert relay.throttled >= 10, relay.throttled  # the relay did throttle: the test proved something
    assert "answered 503 SlowDown; botocore retry 1 of 2" in log
    fs = s3.filesystem()
    # the same files byte for byte (dataset_info.json names the dataset's own location, so it differs)
    sums = {name: {f: d for f, d in json.loads(fs.cat(f"pfthr/datasets/{name}/pf_manifest.json"))["checksums"][
        "files"].items() if f != "dataset_info.json"} for name in ("clean", "thr")}
    assert len(sums["clean"]) >= 2 and sums["thr"] == sums["clean"]
    losses = {name: [h["loss"] for h in json.loads(fs.cat(f"pfthr/runs/{name}/checkpoint-4/trainer_state.json"))[
        "log_history"] if "loss" in h] for name in ("clean", "thr")}
    assert len(losses["clean"]) == 4
    assert losses["thr"] == losses["clean"]  # the same data, the same ops in the same order: to the bit
    assert fs.exists("pfthr/runs/thr/checkpoint-4/pf_trl_checkpoint_complete.json")


@pytest.mark.slow
def test_a_burst_longer_than_botocore_s_retries_is_retried_by_pf_trl(s3, tmp_path):
    """Each request throttled twice in a row: botocore's 2 attempts (AWS_MAX_ATTEMPTS=2, its standard variable: one
    backoff a request instead of two, the same shape as the default 3) all get 503 SlowDown and s3fs raises a plain
    OSError("Please reduce your request rate."); pf-trl recognises it (its ClientError cause) and tries again."""
    relay = S3Relay(s3.port, throttle_first=2)
    try:
        node = Node(tmp_path / "n", s3, relay.endpoint, AWS_MAX_ATTEMPTS="2")
        done = node.run("pretokenize", SOURCE, "s3://pfthr/datasets/burst", "--max_seq_len", "128", "--no_progress")
    finally:
        relay.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    retried = [line for line in done.stderr.splitlines() if "; retry 1 of 3 in " in line]
    assert retried and all(line.startswith("pf-trl: s3://pfthr/") for line in retried), done.stderr[-3000:]
    assert any("Please reduce your request rate." in line for line in retried)  # a GET's or PUT's XML message
    assert s3.filesystem().exists("pfthr/datasets/burst/pf_manifest.json")


@pytest.mark.slow
def test_retries_exhausted_end_in_one_line(s3, tmp_path):
    relay = S3Relay(s3.port, throttle=1.0)
    try:
        node = Node(tmp_path / "n", s3, relay.endpoint, AWS_MAX_ATTEMPTS="1")
        done = node.run("pretokenize", SOURCE, "s3://pfthr/datasets/never", "--max_seq_len", "128", "--no_progress")
    finally:
        relay.stop()
    assert done.returncode == 2, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("pf-trl pretokenize: error: source s3://pfthr/src/train.jsonl: the storage server kept "
                           "refusing with throttling or server errors after 4 tries"), done.stderr[-3000:]
    assert done.stderr.count("retry 3 of 3") == 1  # one warning line per retry, then the failure
