"""Checkpoint uploads that overlap training (pf_trl/trainer/checkpoint_uploads.py) and the resume that checks them
(pf_trl/trainer/checkpoint_fetch.py), against a real S3 server (SeaweedFS) reached through a relay whose uplink is
capped (tests/s3_relay.py): a checkpoint takes about a second to upload while a step takes a fraction of that.

- training steps end while an upload is in flight; each marker is the last object of its checkpoint, lists every
  file with its size, xxh3-128 checksum and the attempt that wrote it;
- a resume from a checkpoint so written continues with the losses of the uninterrupted run;
- a file another attempt overwrote (same size, other bytes) is refused in one line; an upload that fails stops the
  run at the next save in one line, with no marker, the local copy kept.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from s3_relay import S3Relay
from s3_server import s3_server_or_skip

pytestmark = pytest.mark.slow

TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
RUNS = "s3://pfup/runs"
UPLINK = 8 * 2**20  # bytes/s: a checkpoint of the tiny model (~3 MB of weights and optimizer) takes ~0.5 s
MARKER = "pf_trl_checkpoint_complete.json"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = s3_server_or_skip(tmp_path_factory.mktemp("s3"))
    server.make_bucket("pfup")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shards(tmp_path_factory, sample_rows) -> Path:
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize

    from conftest import write_jsonl

    tmp = tmp_path_factory.mktemp("shards")
    pretokenize(write_jsonl(tmp / "rows.jsonl", sample_rows[:96]), tmp / "d", PretokenizeConfig(max_seq_len=128),
                progress=False)
    return tmp / "d"


@pytest.fixture
def relay(s3, monkeypatch, tmp_path):
    from pf_trl.storage import filesystem

    server = S3Relay(s3.port, upload_bytes_per_s=UPLINK)
    for name, value in s3.env(AWS_ENDPOINT_URL=server.endpoint).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "node"))
    filesystem.forget_filesystems()
    yield server
    server.stop()
    filesystem.forget_filesystems()


class StepClock:
    """The time each step ended (``time.monotonic()``), and a hook run at a given step."""

    def __init__(self, at_step: int = 0, hook=None):
        from transformers import TrainerCallback

        clock = self
        self.ends: dict[int, float] = {}

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                clock.ends[state.global_step] = time.monotonic()
                if hook is not None and state.global_step == at_step:
                    hook()

        self.callback = Callback()


def _train(data, output_dir: str, *, max_steps: int = 6, resume=None, callbacks=()):
    from pf_trl.data.shards import load_shards
    from pf_trl.data.tokenizer import resolve_tokenizer
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    args = PaddingFreeConfig(output_dir=output_dir, report_to=[], logging_steps=1, disable_tqdm=True,
                             max_steps=max_steps, save_steps=2, per_device_train_batch_size=4, use_cpu=True,
                             learning_rate=1e-3, dataloader_num_workers=0, seed=0, max_length=None)
    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    trainer = PaddingFreeSFTTrainer(model, args=args, train_dataset=load_shards(data),
                                    processing_class=resolve_tokenizer(None, None), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer, {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def _uploader(trainer):
    from pf_trl.trainer.remote_output import RemoteCheckpointCallback

    (cb,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, RemoteCheckpointCallback)]
    return cb.uploader


def test_uploads_overlap_training_commit_last_and_resume_exactly(relay, s3, shards):
    from pf_trl.data.integrity import file_digest

    clock = StepClock()
    trainer, losses = _train(shards, f"{RUNS}/a", callbacks=[clock.callback])
    uploads = _uploader(trainer).history
    assert [u.step for u in uploads] == [2, 4, 6]
    # training went on during the uploads: a step ended after an upload started and before its files were in
    overlapped = [u.step for u in uploads if any(u.started < t < u.uploaded for t in clock.ends.values())]
    assert overlapped, (clock.ends, [(u.started, u.uploaded) for u in uploads])
    assert all(u.committed and u.error is None for u in uploads)

    # each marker is the last object written of its checkpoint and lists every file with its checksum and attempt
    puts = [p for m, p in relay.log if m == "PUT"]
    fs = s3.filesystem()
    attempts = set()
    for step in (2, 4, 6):
        prefix = f"/pfup/runs/a/checkpoint-{step}/"
        mine = [p for p in puts if p.startswith(prefix)]
        assert mine[-1] == prefix + MARKER and mine.count(prefix + MARKER) == 1
        marker = json.loads(fs.cat(f"pfup/runs/a/checkpoint-{step}/{MARKER}"))
        listed = marker["checksums"]["files"]
        assert set(listed) == {p[len(prefix):] for p in mine[:-1]}
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(listed)
        assert marker["checksums"]["algorithm"] == "xxh3_128"
        attempts |= {e["attempt"] for e in listed.values()} | {marker["attempt"]}
    assert len(attempts) == 1  # one attempt wrote them all
    # the node keeps only the newest checkpoint; its marker's digests are those of the local files
    staged = trainer.pf_remote_output.staging
    assert [p.name for p in staged.glob("checkpoint-*")] == ["checkpoint-6"]
    for name, entry in listed.items():
        assert file_digest(staged / "checkpoint-6" / name) == entry["digest"]

    # resumed from checkpoint-4 (into another prefix, a fresh node cache): the losses of steps 5 and 6
    os.environ["PF_TRL_CACHE"] = str(Path(os.environ["PF_TRL_CACHE"]).with_name("node-b"))
    relay.log.clear()
    _, resumed = _train(shards, f"{RUNS}/b", resume=f"{RUNS}/a/checkpoint-4")
    got = [p for m, p in relay.log if m == "GET" and "/runs/a/checkpoint-4/" in p]
    assert got, "nothing was downloaded from the checkpoint"
    assert {s: resumed[s] for s in (5, 6)} == {s: losses[s] for s in (5, 6)}  # same ops, same order: to the bit


def test_a_file_another_attempt_overwrote_is_refused(relay, s3, shards):
    from pf_trl.errors import ResumeError

    fs = s3.filesystem()
    _train(shards, f"{RUNS}/c", max_steps=2)
    name = "pfup/runs/c/checkpoint-2/trainer_state.json"
    data = bytearray(fs.cat(name))
    data[data.index(b'"global_step"') + 1] = ord("G")  # same size, other bytes: a straggler's copy
    fs.pipe(name, bytes(data))
    with pytest.raises(ResumeError) as refused:
        _train(shards, f"{RUNS}/d", resume=f"{RUNS}/c/checkpoint-2")
    line = str(refused.value)
    attempt = json.loads(fs.cat(f"pfup/runs/c/checkpoint-2/{MARKER}"))["attempt"]
    assert "\n" not in line
    assert "checkpoint-2: trainer_state.json does not match its marker" in line and f"attempt {attempt}" in line


def test_a_failed_upload_stops_the_run_at_the_next_save(relay, s3, shards, monkeypatch):
    from pf_trl.errors import ResumeError

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore gives up at once; pf-trl's own 4 tries stay

    def throttle_everything():
        relay.throttle = 1.0

    clock = StepClock(at_step=1, hook=throttle_everything)
    with pytest.raises(ResumeError) as stopped:
        _train(shards, f"{RUNS}/e", max_steps=6, callbacks=[clock.callback])
    relay.throttle = 0.0
    line = str(stopped.value)
    assert "\n" not in line and f"{RUNS}/e/checkpoint-2 was not uploaded" in line
    assert max(clock.ends) in (2, 3, 4)  # stopped at the save after the failure, not at the end
    assert not s3.filesystem().exists(f"pfup/runs/e/checkpoint-2/{MARKER}")
    staged = next((Path(os.environ["PF_TRL_CACHE"]) / "staging").glob("output-*"))
    assert (staged / "checkpoint-2" / "model.safetensors").is_file()  # the local copy stays: nothing committed it


def test_a_node_fetches_the_shared_files_and_only_its_own_ranks_files():
    from pf_trl.trainer.checkpoint_fetch import files_for_ranks, rank_of

    names = ["model.safetensors", "optimizer.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth",
             "rng_state_2.pth", "pf_trl_stream_state_rank2.json", "pf_trl_stream_buffer_rank3.npz",
             "global_step8/zero_pp_rank_3_mp_rank_00_optim_states.pt", "global_step8/mp_rank_00_model_states.pt",
             "pytorch_model_fsdp_0/__2_0.distcp", "pytorch_model_fsdp_0/.metadata", "rng_state.pth"]
    assert rank_of("rng_state.pth") is None and rank_of("global_step8/mp_rank_00_model_states.pt") is None
    node_b = files_for_ranks(names, {2, 3})
    assert set(node_b) == set(names) - {"rng_state_0.pth", "rng_state_1.pth"}
    assert set(files_for_ranks(names, {0, 1})) == {"model.safetensors", "optimizer.pt", "trainer_state.json",
                                                   "rng_state_0.pth", "rng_state_1.pth",
                                                   "global_step8/mp_rank_00_model_states.pt",
                                                   "pytorch_model_fsdp_0/.metadata", "rng_state.pth"}
    assert files_for_ranks(names, None) == sorted(names)
