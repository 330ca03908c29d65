"""Read-ahead from a bucket (pf_trl/storage/readahead.py, pf_trl/data/lazy_shards.py) against a real S3 server the
module starts (SeaweedFS), reached through a relay (tests/s3_relay.py) that can hold files back:

- a published dataset carries its lengths and row layout, covered by the manifest's checksums;
- training starts while files are still in the bucket (the relay holds every file the first batches do not need
  until step 1 has ended: deterministic), and gives the losses of the same training from the local copy;
- a corrupted shard is refused by its checksum during read-ahead, in one line naming the file;
- ranks of one node download each file once; a DataLoader worker (forked) waits for files and gets the same rows;
- where read-ahead cannot apply the dataset is downloaded whole, and the log says why; a wait is bounded.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
from s3_relay import Gate, S3Relay
from s3_server import s3_server_or_skip

from conftest import LogRecords
from tolerances import assert_bit_equal

pytestmark = pytest.mark.slow

URI = "s3://pfra/datasets/many"
FILES = 24
TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = s3_server_or_skip(tmp_path_factory.mktemp("s3"))
    server.make_bucket("pfra")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def local_shards(tmp_path_factory, sample_rows) -> Path:
    """160 rows of the sample tokenized at max_seq_len 128, written as 24 Arrow files (a dataset of many files)."""
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize
    from pf_trl.data.shards import load_shards, read_manifest, write_manifest

    from conftest import write_jsonl

    tmp = tmp_path_factory.mktemp("shards")
    pretokenize(write_jsonl(tmp / "rows.jsonl", sample_rows[:160]), tmp / "one", PretokenizeConfig(max_seq_len=128),
                progress=False)
    load_shards(tmp / "one").save_to_disk(str(tmp / "many"), num_shards=FILES)
    write_manifest(tmp / "many", read_manifest(tmp / "one"))
    return tmp / "many"


@pytest.fixture(scope="module")
def published(s3, local_shards, tmp_path_factory):
    from pf_trl.data.remote import publish_shards
    from pf_trl.storage import filesystem

    saved = {k: os.environ.get(k) for k in s3.env()}
    os.environ.update(s3.env())
    filesystem.forget_filesystems()
    try:
        publish_shards(local_shards, URI)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        filesystem.forget_filesystems()
    return URI


@pytest.fixture
def relay(s3, published, monkeypatch, tmp_path):
    """This process reaches the bucket through a relay holding back every Arrow file (``relay.gate``), with a node
    cache of its own."""
    from pf_trl.storage import filesystem, readahead

    gate = Gate()
    server = S3Relay(s3.port, gate=gate)
    server.gate_control = gate
    for name, value in s3.env(AWS_ENDPOINT_URL=server.endpoint).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "node"))
    monkeypatch.setenv("PF_TRL_READ_AHEAD_WAIT_S", "60")  # a bug fails the test, never hangs it
    filesystem.forget_filesystems()
    yield server
    gate.open()
    readahead.close_all()
    server.stop()
    filesystem.forget_filesystems()


def _manifest(s3, uri=URI) -> dict:
    return json.loads(s3.filesystem().cat(uri[len("s3://"):] + "/pf_manifest.json"))


def _entry(dataset) -> Path:
    return dataset._ahead.entry


def _tokenizer():
    from pf_trl.data.tokenizer import resolve_tokenizer

    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = resolve_tokenizer(None, None)
    return _TOKENIZER


_TOKENIZER = None


def test_a_published_dataset_carries_its_lengths_and_row_layout(s3, published, local_shards):
    from pf_trl.data.shards import load_shards

    manifest = _manifest(s3)
    layout = manifest["row_layout"]
    assert layout["lengths"] == "pf_lengths.npy" and len(layout["files"]) == FILES
    assert "pf_lengths.npy" in manifest["checksums"]["files"]  # the commit covers it like every file
    assert sum(f["rows"] for f in layout["files"]) == manifest["counts"]["examples"]
    lengths = np.load(local_shards / "pf_lengths.npy")
    assert lengths.tolist() == load_shards(local_shards)["length"]


def _train(data, output_dir: Path, callbacks=(), max_steps: int = 4, trainer_class=None, save_steps=None,
           resume=None):
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    trainer_class = trainer_class or PaddingFreeSFTTrainer  # a subclass given by the test, else the trainer

    args = PaddingFreeConfig(output_dir=str(output_dir), report_to=[], logging_steps=1, disable_tqdm=True,
                             max_steps=max_steps, per_device_train_batch_size=4, use_cpu=True,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                             learning_rate=1e-3, dataloader_num_workers=0, seed=0, max_length=None)
    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    trainer = trainer_class(model, args=args, train_dataset=data, processing_class=_tokenizer(),
                            callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _sampler_of(loader):
    sampler = loader.batch_sampler
    while not hasattr(sampler, "planned_rows"):  # accelerate's wrapper around pf-trl's sampler
        sampler = sampler.batch_sampler
    return sampler


def test_training_starts_before_the_files_are_local_with_the_local_losses(relay, local_shards, tmp_path):
    from transformers import TrainerCallback

    from pf_trl.data.lazy_shards import is_lazy

    gate = relay.gate_control
    seen: dict[str, object] = {}

    class Watch(TrainerCallback):
        """Lets through the files of the first three batches (the loader prefetches one), then, when step 1 has
        ended, looks at the node cache and lets everything through."""

        def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
            data, sampler = train_dataloader.dataset, _sampler_of(train_dataloader)
            first = sampler.planned_rows()[:int(sampler.batch_example_counts(rank=0)[:3].sum())]
            which = np.searchsorted(data._offsets, first, side="right") - 1
            seen["needed"] = {data.files[f] for f in which.tolist()}
            seen["entry"] = _entry(data)
            gate.allow(seen["needed"])

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                seen["local at step 1"] = {p.name for p in seen["entry"].glob("*.arrow")}
                seen["complete at step 1"] = (seen["entry"] / ".complete").exists()
                gate.open()

    trainer, from_bucket = _train(URI, tmp_path / "bucket", callbacks=[Watch()])
    assert is_lazy(trainer.train_dataset)
    assert seen["local at step 1"] <= seen["needed"], "a file the first batches do not need was read before step 1"
    assert len(seen["local at step 1"]) < FILES and not seen["complete at step 1"]
    assert gate.held, "the relay held no file back: the test proved nothing"
    _, from_local = _train(str(local_shards), tmp_path / "local")
    assert len(from_bucket) == 4
    assert_bit_equal(from_bucket, from_local, why="the same rows and lengths, so the same sampler plan, batches and "
                     "packing in one process: only where the bytes come from differs")


def test_a_corrupted_shard_is_refused_during_read_ahead(relay, s3, local_shards, monkeypatch):
    from pf_trl.data.lazy_shards import open_lazy_shards
    from pf_trl.data.shards import ShardsError

    monkeypatch.setenv("PF_TRL_READ_AHEAD_STREAMS", "1")  # files in order: file 0 is read before file 5 fails

    fs = s3.filesystem()
    manifest = _manifest(s3)
    writer = manifest["storage_files_prefix"]
    bad = manifest["row_layout"]["files"][5]["file"]
    for name in manifest["checksums"]["files"]:
        data = bytearray(fs.cat(f"pfra/datasets/many/{writer}/{name}"))
        if name == bad:
            data[len(data) // 2] ^= 0xFF  # same size, other bytes
        fs.pipe(f"pfra/datasets/corrupt/{writer}/{name}", bytes(data))
    fs.pipe("pfra/datasets/corrupt/pf_manifest.json", json.dumps(manifest).encode())
    relay.gate_control.open()
    lazy = open_lazy_shards("s3://pfra/datasets/corrupt")
    assert lazy[0]["input_ids"]  # file 0 is sound
    row = int(lazy._offsets[5])
    with pytest.raises(ShardsError) as exc:
        lazy[row]
    line = str(exc.value)
    assert "\n" not in line
    assert line.startswith(f"s3://pfra/datasets/corrupt: shard file {bad} does not match its xxh3_128 checksum")
    assert not (_entry(lazy) / bad).exists()  # never cached under its name
    with pytest.raises(ShardsError, match=bad):  # the read-ahead stopped: every later read says so
        lazy[int(lazy._offsets[7])]
    with pytest.raises(ShardsError, match=bad):  # even of a file already local
        lazy[0]
    # a DataLoader worker (forked) finds the failure in the node cache; the CLI's line is the error, not its traceback
    import torch

    from pf_trl.cli.flags import one_line
    from pf_trl.storage import StorageError

    loader = torch.utils.data.DataLoader(lazy, batch_sampler=[[int(lazy._offsets[7])]], collate_fn=lambda rows: rows,
                                         num_workers=1, multiprocessing_context="fork")
    with pytest.raises(StorageError) as exc:
        list(loader)
    assert one_line(exc.value) == line


def _rank(uri: str, reverse: bool, counter: str, queue) -> None:
    """A rank of the node (forked): no handle of its parent; its own read-ahead, in its own order; downloads counted."""
    from pf_trl.data.lazy_shards import open_lazy_shards
    from pf_trl.storage import filesystem, readahead

    inherited = [k for k in filesystem._FILESYSTEMS if k[0] != os.getpid()]
    real = readahead.download

    def counted(source, target):
        with open(counter, "a") as f:
            f.write(f"{os.getpid()} {str(source).rsplit('/', 1)[-1]}\n")
        real(source, target)

    readahead.download = counted
    lazy = open_lazy_shards(uri)
    rows = np.arange(len(lazy))[::-1 if reverse else 1]
    lazy.follow(rows)
    got = lazy.__getitems__(rows.tolist())
    lazy._ahead.wait_all()  # the small files after the Arrow ones
    queue.put((inherited, len(got)))
    readahead.close_all()


def test_ranks_of_one_node_download_each_file_once(relay, s3, tmp_path):
    import time

    from pf_trl.storage.filesystem import filesystem

    filesystem(URI)  # the parent holds a handle when it forks
    gate, counter = relay.gate_control, tmp_path / "downloads"
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(URI, reverse, str(counter), queue)) for reverse in (False, True)]
    for p in ranks:
        p.start()
    firsts = {f"data-00000-of-000{FILES}.arrow", f"data-000{FILES - 1}-of-000{FILES}.arrow"}
    deadline = time.monotonic() + 60
    while not firsts <= set(gate.held) and time.monotonic() < deadline:  # each rank is downloading its first file
        time.sleep(0.05)
    gate.open()
    results = [queue.get(timeout=120) for _ in ranks]
    for p in ranks:
        p.join(60)
    assert [p.exitcode for p in ranks] == [0, 0]
    rows = _manifest(s3)["counts"]["examples"]
    assert results == [([], rows), ([], rows)]  # no fsspec handle crossed the fork; every row read
    lines = [line.split() for line in counter.read_text().splitlines()]
    names = [name for _, name in lines]
    assert sorted(names) == sorted(set(names)) and len(names) == len(_manifest(s3)["checksums"]["files"])
    assert len({pid for pid, _ in lines}) == 2  # both ranks downloaded, neither twice


def test_a_dataloader_worker_waits_for_the_files_and_reads_the_same_rows(relay, local_shards):
    import torch

    from pf_trl.batching.sampler import TokenBudgetBatchSampler
    from pf_trl.data.lazy_shards import open_lazy_shards
    from pf_trl.data.shards import load_shards

    lazy = open_lazy_shards(URI)
    local = load_shards(local_shards)
    sampler = TokenBudgetBatchSampler(lazy.pf_lengths, 512, seed=3)
    assert np.array_equal(lazy.pf_lengths, np.asarray(local["length"]))
    lazy.follow(sampler.planned_rows())
    loader = torch.utils.data.DataLoader(lazy.select_columns(["input_ids", "labels"]), batch_sampler=sampler,
                                         collate_fn=lambda rows: rows, num_workers=1,
                                         multiprocessing_context="fork")
    batches = iter(loader)  # the worker is forked now, with none of the Arrow files local
    assert not any(_entry(lazy).glob("*.arrow"))
    relay.gate_control.open()
    batches = list(batches)
    expected = [[{"input_ids": local[i]["input_ids"], "labels": local[i]["labels"]} for i in b] for b in sampler]
    assert batches == expected
    import pickle

    clone = pickle.loads(pickle.dumps(lazy))  # a spawned worker's copy: no thread, no lock, no memory map
    assert clone._ahead._threads == [] and clone._ahead._lock_file is None and clone._tables == {}
    assert clone[7] == lazy[7]


def test_where_read_ahead_does_not_apply_the_dataset_is_downloaded_whole(relay, s3, monkeypatch):
    import types

    import datasets

    from pf_trl.data.lazy_shards import admit, is_lazy, open_lazy_shards
    from pf_trl.data.sources import load_training_data

    relay.gate_control.open()
    records = LogRecords()
    loggers = [logging.getLogger(name) for name in ("pf_trl.storage", "pf_trl.trainer")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.addHandler(records)
        log.setLevel(logging.INFO)
    try:
        args = dict(padding_free_mode="internal", shuffle_dataset=False, max_length=None)
        lazy = open_lazy_shards(URI)
        assert admit(lazy, args=types.SimpleNamespace(**args), what="training", vocab=32000) is lazy
        for change, said in ((dict(shuffle_dataset=True), "shuffle_dataset=True"),
                             (dict(padding_free_mode="none"), "padded training"),
                             (dict(max_length=16), "max_length 16 may cut or drop rows")):
            whole = admit(lazy, args=types.SimpleNamespace(**{**args, **change}), what="training", vocab=32000)
            assert isinstance(whole, datasets.Dataset) and whole.num_rows == len(lazy)
            assert any(said in m and URI in m for m in records.messages), records.messages
        assert isinstance(admit(lazy, args=types.SimpleNamespace(**args), what="evaluation", vocab=32000),
                          datasets.Dataset)
        assert isinstance(admit(lazy, args=types.SimpleNamespace(**args), what="training", vocab=100),
                          datasets.Dataset)  # the shards' vocabulary does not fit: every id is checked
        # a dataset published before row layouts: downloaded whole, and said
        manifest = _manifest(s3)
        manifest.pop("row_layout")
        fs = s3.filesystem()
        writer = manifest["storage_files_prefix"]
        for name in manifest["checksums"]["files"]:
            fs.pipe(f"pfra/datasets/old/{writer}/{name}", fs.cat(f"pfra/datasets/many/{writer}/{name}"))
        fs.pipe("pfra/datasets/old/pf_manifest.json", json.dumps(manifest).encode())
        old = load_training_data("s3://pfra/datasets/old", _tokenizer(), read_ahead=True)
        assert isinstance(old, datasets.Dataset) and old.num_rows == len(lazy)
        assert any("s3://pfra/datasets/old was published without its row layout" in m for m in records.messages)
        monkeypatch.setenv("PF_TRL_READ_AHEAD", "0")
        assert not is_lazy(load_training_data(URI, _tokenizer(), read_ahead=True))
        assert any("PF_TRL_READ_AHEAD=0" in m for m in records.messages)
    finally:
        for log, level in zip(loggers, levels):
            log.removeHandler(records)
            log.setLevel(level)


def test_a_file_that_does_not_arrive_in_time_is_one_line_naming_it(relay, monkeypatch):
    from pf_trl.data.lazy_shards import open_lazy_shards
    from pf_trl.storage import StorageError

    lazy = open_lazy_shards(URI)  # the relay holds every Arrow file
    monkeypatch.setenv("PF_TRL_READ_AHEAD_WAIT_S", "0.5")
    with pytest.raises(StorageError) as exc:
        lazy[0]
    line = str(exc.value)
    assert "\n" not in line
    assert line.startswith(f"{URI}/w-") and "/data-00000-of-00024.arrow: not in the node cache after 0.5 s" in line
    assert "PF_TRL_READ_AHEAD_WAIT_S" in line


def test_the_training_set_read_as_evaluation_data_too_is_downloaded_once(relay):
    """The same URI as --training_data_path and --validation_data_path: the whole download of the evaluation data
    completes this process's own read-ahead rather than waiting for its lock (or downloading a second copy)."""
    from pf_trl.data.lazy_shards import open_lazy_shards
    from pf_trl.data.remote import fetch_shards

    lazy = open_lazy_shards(URI)  # holds the entry's lock shared; nothing downloaded yet
    relay.gate_control.open()
    whole = fetch_shards(URI)
    assert whole == _entry(lazy) and (whole / ".complete").is_file() and lazy.is_local()
    gets = [path.rsplit("/", 1)[-1] for method, path in relay.log if method == "GET" and "/w-" in path]
    assert sorted(gets) == sorted(set(gets))  # each file once


def test_a_dataset_downloaded_whole_before_is_read_ahead_from_the_cache(relay, local_shards):
    """A node that downloaded the dataset whole (`pf-trl inspect`, evaluation data) and then trains on it: the
    read-ahead finds the entry complete and reads it as it is (it failed marking the entry complete a second time)."""
    from pf_trl.data.lazy_shards import open_lazy_shards
    from pf_trl.data.remote import fetch_shards
    from pf_trl.data.shards import load_shards

    relay.gate_control.open()
    whole = fetch_shards(URI)
    lazy = open_lazy_shards(URI)
    assert _entry(lazy) == whole
    lazy.follow(range(len(lazy)))
    for thread in lazy._ahead._threads:  # each finds nothing left to download
        thread.join(timeout=60)
    assert lazy._ahead.wait_all() == whole  # raises the read-ahead's error, if any
    assert [lazy[i]["input_ids"] for i in range(len(lazy))] == load_shards(local_shards)["input_ids"]


def test_the_whole_dataset_is_opened_only_once_its_small_files_are_local_too(relay):
    """Every Arrow file local but ``dataset_info.json`` still held back (a throttled GET of it retried): the dataset is
    not whole yet, so the check of the data's identity at train start reads the lengths, never a half entry (it
    opened one and failed "neither a Dataset directory nor a DatasetDict directory")."""
    from pf_trl.data.lazy_shards import open_lazy_shards
    from pf_trl.trainer.resume import data_identity

    lazy = open_lazy_shards(URI)  # its lengths local; nothing else downloaded, no thread started yet
    relay.gate_control.open()
    for name in lazy.files:
        lazy._ahead.fetch_now(name)
    rest = sorted(set(lazy._ahead.files) - set(lazy.files) - {"pf_lengths.npy"})
    assert "dataset_info.json" in rest and all(not (_entry(lazy) / n).exists() for n in rest)
    assert not lazy.is_local() and lazy.local_dataset() is None
    partial = data_identity(lazy)
    assert partial["content"] is None and partial["examples"] == len(lazy)
    for name in rest:  # the control: with them in, the same calls open the whole dataset
        lazy._ahead.fetch_now(name)
    assert lazy.is_local() and len(lazy.local_dataset()) == len(lazy)
    assert data_identity(lazy)["content"] is not None


class CacheWatch:
    """The node cache's size (every file under it), sampled every few milliseconds from a thread while a run goes."""

    def __init__(self, root: Path):
        import threading

        self.root, self.sizes, self._stop = root, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        from pf_trl.storage.space import held_bytes

        while not self._stop.is_set():
            self.sizes.append(held_bytes(self.root) if self.root.is_dir() else 0)
            self._stop.wait(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _arrow_bytes(s3) -> dict[str, int]:
    return {n: f["bytes"] for n, f in _manifest(s3)["checksums"]["files"].items() if n.endswith(".arrow")}


def test_a_dataset_three_times_the_cache_streams_shard_grouped_within_the_limit_with_the_local_losses(
        relay, s3, local_shards, tmp_path, monkeypatch):
    from collections import Counter

    from pf_trl.data.lazy_shards import is_lazy, shard_window
    from pf_trl.storage import readahead
    from pf_trl.trainer import PaddingFreeSFTTrainer

    arrow = _arrow_bytes(s3)
    limit = sum(arrow.values()) // 3
    assert limit > 3 * max(arrow.values()) + 4096
    monkeypatch.setenv("PF_TRL_REMOTE_CACHE_SIZE", str(limit))
    root = tmp_path / "node" / "remote"
    # what a killed process left: a whole download's .tmp folder and a partial read-ahead entry; both count
    for leftover in (root / ".0badc0ffee.tmp", root / "0deadbeef" / ".readahead"):
        leftover.mkdir(parents=True)
        (leftover / "cut-short.part").write_bytes(b"x" * (limit // 4))
    relay.gate_control.open()
    logs, log = LogRecords(), logging.getLogger("pf_trl.trainer")
    log.addHandler(logs)
    monkeypatch.setattr(log, "level", logging.INFO)
    try:
        with CacheWatch(root) as watch:
            trainer, from_bucket = _train(URI, tmp_path / "bucket", max_steps=8, save_steps=4)
    finally:
        log.removeHandler(logs)
    data = trainer.train_dataset
    assert is_lazy(data) and data._ahead.streaming
    sampler = trainer._pf_train_sampler
    window = limit // (2 * max(arrow.values()))
    assert sampler.group_shards == window < FILES and sampler.shard_bounds.tolist() == data._offsets.tolist()
    assert any(f"shard-grouped shuffle, its {FILES} files in a random order" in m and f"windows of {window} files" in m
               for m in logs.messages)
    stats = data._ahead.stats
    assert stats["files_downloaded"] > limit // max(arrow.values())  # more than the cache holds: it was streamed
    assert max(watch.sizes) <= limit, (max(watch.sizes), limit)
    assert not (root / ".0badc0ffee.tmp").exists() and not (root / "0deadbeef").exists()  # cleaned for room
    assert not (_entry(data) / ".complete").exists()
    gets = Counter(path.rsplit("/", 1)[-1] for method, path in relay.log if method == "GET" and path.endswith(".arrow"))
    assert gets and max(gets.values()) == 1, gets  # no file downloaded twice (the global shuffle's are: next test)
    # the local copy trained with the same plan: the same rows, the same losses, to the bit

    class SameGrouping(PaddingFreeSFTTrainer):
        def _pf_sampler(self, *args, **kwargs):
            local = super()._pf_sampler(*args, **kwargs)
            local.set_grouping(window, data._offsets)
            return local

    _, from_local = _train(str(local_shards), tmp_path / "local", max_steps=8, trainer_class=SameGrouping)
    assert len(from_bucket) == 8 and from_bucket == from_local
    # resumed mid-epoch on a node whose cache would choose other windows: the checkpoint's plan, the same losses
    readahead.close_all()
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "other-node"))
    monkeypatch.setenv("PF_TRL_REMOTE_CACHE_SIZE", str(limit * 3 // 4))
    resumed, after = _train(URI, tmp_path / "resumed", max_steps=8, resume=str(tmp_path / "bucket" / "checkpoint-4"))
    assert shard_window(resumed.train_dataset) != window == resumed._pf_train_sampler.group_shards
    assert len(after) == 8 and after[4:] == from_bucket[4:]  # the first four: the checkpoint's log history


@pytest.mark.slow
def test_a_streamed_dataset_is_fetched_ahead_in_each_epochs_plan(relay, s3, tmp_path, monkeypatch):
    """Two epochs of a dataset three times the node cache: the read-ahead follows the first epoch's plan when the
    dataloader is built, then the second epoch's when it starts (not the first one's again, nor on demand)."""
    from transformers import TrainerCallback

    from pf_trl.batching.sampler import TokenBudgetBatchSampler
    from pf_trl.data.lazy_shards import LazyShards
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    arrow = _arrow_bytes(s3)
    monkeypatch.setenv("PF_TRL_REMOTE_CACHE_SIZE", str(sum(arrow.values()) // 3))
    followed: list[np.ndarray] = []
    real_follow = LazyShards.follow

    def follow(self, rows):  # records what the read-ahead was told, then tells it
        followed.append(np.asarray(rows).copy())
        return real_follow(self, rows)

    monkeypatch.setattr(LazyShards, "follow", follow)
    class StopInSecondEpoch(TrainerCallback):  # its first step is enough: the plan is followed when it starts
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.epoch > 1

    relay.gate_control.open()
    args = PaddingFreeConfig(output_dir=str(tmp_path / "out"), report_to=[], disable_tqdm=True, num_train_epochs=2,
                             max_tokens_per_batch=8192, use_cpu=True, save_strategy="no", learning_rate=1e-3,
                             dataloader_num_workers=0, seed=0, max_length=None)
    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    trainer = PaddingFreeSFTTrainer(model, args=args, train_dataset=URI, processing_class=_tokenizer(),
                                    callbacks=[StopInSecondEpoch()])
    trainer.train()
    data, sampler = trainer.train_dataset, trainer._pf_train_sampler
    assert data.streamed and sampler.grouped and trainer.state.global_step == len(sampler) + 1
    plans = []
    for epoch in (0, 1):
        fresh = TokenBudgetBatchSampler(data.pf_lengths, sampler.max_tokens, seed=0, shard_bounds=data._offsets,
                                        group_shards=sampler.group_shards)
        fresh.set_epoch(epoch)
        plans.append(fresh.planned_rows())
    assert not np.array_equal(plans[0], plans[1])  # control: the epochs' plans differ, so the check below can fail
    assert len(followed) == 2 and all(np.array_equal(f, p) for f, p in zip(followed, plans))
    assert data._ahead.stats["files_downloaded"] > len(arrow)  # both epochs streamed: files downloaded again


def test_a_streamed_dataset_resumed_mid_epoch_fetches_only_what_is_still_to_be_read(relay, s3, local_shards,
                                                                                  monkeypatch):
    from pf_trl.batching.sampler import TokenBudgetBatchSampler
    from pf_trl.data.lazy_shards import admit, open_lazy_shards
    from pf_trl.data.shards import load_shards
    from pf_trl.storage import StorageError

    arrow = _arrow_bytes(s3)
    monkeypatch.setenv("PF_TRL_REMOTE_CACHE_SIZE", str(sum(arrow.values()) // 3))
    lazy = open_lazy_shards(URI)
    assert lazy._ahead.streaming
    sampler = TokenBudgetBatchSampler(lazy.pf_lengths, 256, seed=5)
    batches = list(sampler)
    skip = len(batches) // 2
    rest = [i for b in batches[skip:] for i in b]
    files = np.asarray(lazy.files)
    read_later = set(files[np.searchsorted(lazy._offsets, rest, side="right") - 1])
    skipped_only = set(arrow) - read_later
    assert skipped_only, "every file is read again after the skipped batches: the test would prove nothing"
    lazy.follow(sampler.planned_rows(skip_batches=skip))
    local = load_shards(local_shards)
    relay.gate_control.open()
    for batch in batches[skip:]:
        assert lazy.__getitems__(batch) == [local[i] for i in batch]
    gets = [path.rsplit("/", 1)[-1] for method, path in relay.log if method == "GET" and path.endswith(".arrow")]
    assert set(gets) == read_later and not set(gets) & skipped_only
    # the global shuffle under a bounded cache downloads files again and again (what the shard-grouped one avoids)
    assert len(gets) > len(set(gets))
    # read by DataLoader workers it cannot be: one line, naming the fix
    import types

    with pytest.raises(StorageError, match="pass --dataloader_num_workers 0"):
        admit(lazy, args=types.SimpleNamespace(dataloader_num_workers=2), what="training", vocab=32000)
    lazy._ahead.close()
    # a limit below three of its largest files cannot stream it: refused at open, in one line
    monkeypatch.setenv("PF_TRL_REMOTE_CACHE_SIZE", str(2 * max(arrow.values())))
    from pf_trl.storage import readahead

    readahead.close_all()
    with pytest.raises(StorageError, match="holds fewer than three of its largest files"):
        open_lazy_shards(URI)


def test_files_are_ordered_by_their_first_planned_row_from_the_shortest_prefix():
    """The read-ahead's order of a plan read whole (each file downloaded once): every file the plan reads, in the
    order of its first read; a file first read late in the plan (past the first prefix looked at) is still there."""
    from pf_trl.data.lazy_shards import _first_reads

    rng = np.random.default_rng(0)
    for files, rows in ((700, 5_000), (3, 50), (100, 200_000)):
        which = rng.integers(0, files, rows)
        which[-1] = files  # one more file, read only by the plan's last row
        expected = list(dict.fromkeys(which.tolist()))
        assert _first_reads(which, files + 1).tolist() == expected
    # negative control (100 files, 200,000 rows): told one file fewer, it stops at a prefix without the late file
    assert _first_reads(which, files).tolist() == expected[:-1]
