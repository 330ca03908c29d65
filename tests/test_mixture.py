"""Data mixtures: fms-hf-tuning's data config read as it is, exact ratios with a fresh draw per epoch, the same batches
through the CLI, the Python API and a pretokenized mixture directory (what the service writes), exact resume."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from conftest import write_jsonl

TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
TINY_FLAG = "num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,num_key_value_heads=1"
WEIGHTS = (0.5, 0.3, 0.2)


def _pairs(sample_rows, n, offset=0):
    out = []
    for row in sample_rows[offset:offset + n]:
        q = row["prompt"].removeprefix("### Instruction:\n").removesuffix("\n\n### Response:\n")
        out.append((q[:400], row["completion"][:600]))
    return out


@pytest.fixture(scope="module")
def three_sources(tmp_path_factory, sample_rows):
    """Alpaca, ShareGPT and chat-messages files (different rows in each) and a data config mixing them 0.5/0.3/0.2."""
    d = tmp_path_factory.mktemp("mix")
    write_jsonl(d / "alpaca.jsonl", [{"instruction": q, "input": "", "output": a} for q, a in _pairs(sample_rows, 60)])
    write_jsonl(d / "sharegpt.jsonl", [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
                                       for q, a in _pairs(sample_rows, 50, 100)])
    write_jsonl(d / "chats.jsonl", [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                                    for q, a in _pairs(sample_rows, 40, 200)])
    (d / "mix.yaml").write_text(
        "dataprocessor:\n  type: default\n  streaming: false\n  seed: 11\n  sampling_stopping_strategy: all_exhausted\n"
        "datasets:\n"
        "  - name: alpaca\n    sampling: 0.5\n    data_paths: [alpaca.jsonl]\n"
        "  - name: sharegpt\n    sampling: 0.3\n    data_paths: [sharegpt.jsonl]\n    input_format: sharegpt\n"
        "  - name: chats\n    sampling: 0.2\n    data_paths: [chats.jsonl]\n")
    return d


# ------------------------------------------------------------------------------------ the schedule (numpy only)


def _lengths(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.integers(10, 300, n) for n in sizes])


def _bounds(sizes):
    edges = np.concatenate([[0], np.cumsum(sizes)])
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


def test_schedule_exact_ratios_and_a_fresh_draw_each_epoch():
    from pf_trl.batching.mixture_sampler import MixtureSchedule

    sizes = [400, 300, 50]
    lengths = _lengths(sizes)
    schedule = MixtureSchedule(lengths, _bounds(sizes), WEIGHTS, seed=3, stopping_strategy="first_exhausted")
    n = schedule.epoch_examples
    assert n == 250  # the largest epoch in which no source repeats: 50 / 0.2
    seen = {s: [] for s in range(3)}
    for epoch in range(4):
        rows = schedule.rows(epoch)
        assert len(rows) == n
        source = np.searchsorted(np.cumsum(sizes), rows, side="right")
        for s, w in enumerate(WEIGHTS):
            share = float(np.mean(source == s))
            assert abs(share - w) <= 1 / n + 1e-12, (epoch, s, share)
            seen[s].append(rows[source == s])
    # source 0 (400 rows, 125 drawn per epoch): other rows each epoch, every row before any repeats
    assert not set(seen[0][0].tolist()) & set(seen[0][1].tolist())
    assert len(set(np.concatenate(seen[0])[:400].tolist())) == 400
    # source 2 (50 rows, 50 drawn): whole each epoch, in a new order
    assert sorted(seen[2][0].tolist()) == sorted(seen[2][1].tolist()) and seen[2][0].tolist() != seen[2][1].tolist()
    # all_exhausted (the default): the smallest epoch in which every source is seen whole
    every = MixtureSchedule(lengths, _bounds(sizes), WEIGHTS, seed=3)
    assert every.epoch_examples == 1000
    assert all(c >= s for c, s in zip(every.epoch_counts(0), sizes))


def test_schedule_by_tokens_shares_tokens():
    from pf_trl.batching.mixture_sampler import MixtureSchedule

    sizes = [500, 300, 200]
    lengths = _lengths(sizes, seed=1)
    lengths[:500] *= 3  # source 0 has long examples: by examples its token share would be far above its weight
    by_tokens = MixtureSchedule(lengths, _bounds(sizes), WEIGHTS, seed=0, sample_by="tokens")
    by_examples = MixtureSchedule(lengths, _bounds(sizes), WEIGHTS, seed=0)
    for epoch in range(3):
        shares = by_tokens.shares(epoch)
        total = sum(s["tokens"] for s in shares)
        for s, w in zip(shares, WEIGHTS):
            assert abs(s["share_of_tokens"] - w) <= lengths.max() / total, shares
    assert abs(by_examples.shares(0)[0]["share_of_tokens"] - WEIGHTS[0]) > 0.1  # the negative control


def test_mixture_sampler_resumes_exactly_at_every_batch():
    from pf_trl.batching.mixture_sampler import MixtureBatchSampler, MixtureSchedule

    sizes = [120, 60, 40]
    lengths = _lengths(sizes, seed=2)
    make = lambda **kw: MixtureBatchSampler(MixtureSchedule(lengths, _bounds(sizes), WEIGHTS, seed=5), 1024, seed=1,
                                            num_epochs=3, **kw)
    full = make()
    plans = []
    for epoch in range(3):
        full.set_epoch(epoch)
        plans.append(list(full))
        assert len(plans[-1]) == len(full), "the same batch count every epoch"
        assert all(sum(lengths[b]) <= 1024 for b in plans[-1])
    assert plans[0] != plans[1]
    for epoch in (0, 2):
        for k in range(len(full) + 1):
            probe = make()
            probe.set_epoch(epoch)
            it = iter(probe)
            for _ in range(k):
                next(it)
            state = json.loads(json.dumps(probe.state_dict()))
            resumed = make()
            resumed.load_state_dict(state)
            assert list(resumed) == plans[epoch][k:], (epoch, k)
    other = MixtureBatchSampler(MixtureSchedule(lengths, _bounds(sizes), (0.4, 0.4, 0.2), seed=5), 1024, seed=1,
                                num_epochs=3)
    with pytest.raises(ValueError, match="mixture differs"):
        other.load_state_dict(full.state_dict())
    # two ranks: the same batch count, and together exactly the epoch's draw (each drawn row once per draw)
    ranks = [make(num_replicas=2, rank=r) for r in (0, 1)]
    b0, b1 = (list(s) for s in ranks)
    assert len(b0) == len(b1) == len(ranks[0])
    drawn = ranks[0].schedule.rows(0)
    assert sorted(i for b in b0 + b1 for i in b) == sorted(drawn.tolist())


# ------------------------------------------------------------------------------------------- data configs


def test_fms_data_config_read_as_it_is(tmp_path, three_sources):
    from pf_trl.data.data_config import read_data_config

    (tmp_path / "fms.yaml").write_text(
        "dataprocessor:\n  type: default\n  streaming: false\n  sampling_stopping_strategy: first_exhausted\n"
        "  seed: 66\ndatasets:\n"
        f"  - name: dataset_1\n    sampling: 0.7\n    data_paths:\n      - {three_sources / 'alpaca.jsonl'}\n"
        "    retain_columns: [instruction, output]\n"
        f"  - name: dataset_2\n    sampling: 0.3\n    data_paths:\n      - {three_sources}/chat*.jsonl\n")
    config = read_data_config(tmp_path / "fms.yaml")
    assert [s.name for s in config.sources] == ["dataset_1", "dataset_2"]
    assert config.seed == 66 and config.stopping_strategy == "first_exhausted" and config.weights() == [0.7, 0.3]
    json_config = tmp_path / "fms.json"
    json_config.write_text(json.dumps({"dataprocessor": {"type": "default"}, "datasets": [
        {"name": "a", "data_paths": [str(three_sources / "alpaca.jsonl")]}]}))
    assert not read_data_config(json_config).is_mixture  # no sampling: a plain concatenation


@pytest.mark.parametrize("entry, message", [
    ("data_handlers:\n      - name: tokenize_and_apply_input_masking\n        arguments: {fn_kwargs: {}}",
     "data_handlers \\['tokenize_and_apply_input_masking'\\] are not implemented"),
    ("builder: arrow", "builder 'arrow' is not read"),
    ("colour: blue", "unknown key\\(s\\) \\['colour'\\]"),
    ("input_format: yaml", "input_format 'yaml' is unknown"),
])
def test_data_config_refusals_name_the_entry(tmp_path, three_sources, entry, message):
    from pf_trl.data.data_config import DataConfigError, read_data_config

    (tmp_path / "bad.yaml").write_text(
        f"datasets:\n  - name: first\n    data_paths: [{three_sources / 'alpaca.jsonl'}]\n    {entry}\n")
    with pytest.raises(DataConfigError, match=message) as info:
        read_data_config(tmp_path / "bad.yaml")
    assert "'first'" in str(info.value)


def test_data_config_weights_on_some_datasets_only_refused(three_sources):
    from pf_trl.data.data_config import DataConfigError, data_config_from_sources

    with pytest.raises(DataConfigError, match="have no `sampling`"):
        data_config_from_sources([{"name": "a", "data_paths": [str(three_sources / "alpaca.jsonl")], "sampling": 1},
                                  {"name": "b", "data_paths": [str(three_sources / "chats.jsonl")]}])


# ----------------------------------------------------------------------- CLI = Python API = a mixture directory


def _batches(trainer, epochs=2):
    """Content hashes of the examples of each batch of the first epochs, and each source's share of examples."""
    trainer.get_train_dataloader()
    sampler = trainer._pf_train_sampler
    ds = trainer.train_dataset
    ids = ds.select_columns(["input_ids"])
    out, shares = [], []
    bounds = [tuple(s["rows"]) for s in ds.pf_manifest["sources"]]
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        out.append([[hashlib.sha1(str(ids[i]["input_ids"]).encode()).hexdigest()[:12] for i in b] for b in batches])
        rows = np.asarray([i for b in batches for i in b])
        shares.append([float(np.mean((rows >= a) & (rows < z))) for a, z in bounds])
    return out, shares


@pytest.mark.slow
def test_cli_api_and_mixture_dir_same_batches(tmp_path, three_sources, tokenizer, monkeypatch):
    from pf_trl.cli.train import build, parse_args
    from pf_trl.data.data_config import read_data_config
    from pf_trl.data.mixture import load_mixture, write_mixture_shards
    from pf_trl.data.pretokenize import PretokenizeConfig
    from pf_trl.data.shards import load_shards
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))
    common = dict(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_length=512, num_train_epochs=2,
                  max_tokens_per_batch=2048, save_strategy="no", disable_tqdm=True)
    argv = ["--data_config", str(three_sources / "mix.yaml"), "--model_overrides", TINY_FLAG, "--max_seq_len", "512",
            "--output_dir", common["output_dir"], "--report_to", "none", "--use_cpu", "True", "--num_train_epochs", "2",
            "--max_tokens_per_batch", "2048", "--save_strategy", "no"]
    cli = build(*parse_args(argv), quiet=True)
    api = PaddingFreeSFTTrainer(build_model("pf-trl/tiny-llama", seed=42, **TINY), args=PaddingFreeConfig(**common),
                                train_dataset=str(three_sources / "mix.yaml"), processing_class=tokenizer)
    mixture = load_mixture(read_data_config(three_sources / "mix.yaml"), tokenizer, PretokenizeConfig(max_seq_len=512))
    write_mixture_shards(mixture, tmp_path / "mixdir")
    from_dir = PaddingFreeSFTTrainer(build_model("pf-trl/tiny-llama", seed=42, **TINY), args=PaddingFreeConfig(**common),
                                     train_dataset=load_shards(tmp_path / "mixdir"), processing_class=tokenizer)
    results = [_batches(t) for t in (cli, api, from_dir)]
    assert results[0][0] == results[1][0] == results[2][0], "the same batches on the three paths"
    batches, shares = results[0]
    assert batches[0] != batches[1], "a fresh draw in epoch 2"
    for epoch_shares in shares:
        assert all(abs(s - w) <= 0.01 for s, w in zip(epoch_shares, WEIGHTS)), epoch_shares
    # the negative control: the concatenation in the same directory without its rule trains each row once
    manifest = json.loads((tmp_path / "mixdir" / "pf_manifest.json").read_text())
    assert [s["input_format"] for s in manifest["sources"]] == ["alpaca", "sharegpt", "messages"]


@pytest.mark.slow
def test_mixture_training_resumes_exactly(tmp_path, three_sources, tokenizer, monkeypatch):
    """A checkpoint in the middle of epoch 2 of a mixture: the resumed run trains the same examples in the same
    batches as the uninterrupted one, to the same weights."""
    import torch

    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)

    class Recording(PaddingFreeSFTTrainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.trained = []

        def compute_loss(self, model, inputs, *a, **kw):
            if self.model.training:
                self.trained.append((self.state.global_step, hashlib.sha1(inputs["input_ids"].numpy().tobytes()).hexdigest()))
            return super().compute_loss(model, inputs, *a, **kw)

    small = {}
    for name in ("alpaca", "chats"):  # a few rows: a handful of steps per epoch
        rows = [json.loads(line) for line in (three_sources / f"{name}.jsonl").read_text().splitlines()[:16]]
        small[name] = str(write_jsonl(tmp_path / f"{name}.jsonl", rows))
    sources = [(small["alpaca"], 0.6), (small["chats"], 0.4)]

    def run(out, **kw):
        args = PaddingFreeConfig(output_dir=str(out), report_to=[], use_cpu=True, max_length=128, num_train_epochs=2,
                                 max_tokens_per_batch=1024, disable_tqdm=True, learning_rate=1e-3, seed=0,
                                 lr_scheduler_type="constant", logging_steps=100, **kw)
        model = build_model("pf-trl/tiny-llama", seed=0, **TINY)
        return Recording(model, args=args, train_dataset=sources, processing_class=tokenizer)

    full = run(tmp_path / "full", save_strategy="no")
    full.train()
    per_epoch = full.state.global_step // 2
    stop = per_epoch + per_epoch // 2
    first = run(tmp_path / "run", save_strategy="steps", save_steps=stop, max_steps=stop)
    first.train()
    resumed = run(tmp_path / "run", save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / f"checkpoint-{stop}"))
    assert first.trained == full.trained[:len(first.trained)]
    assert resumed.trained == full.trained[len(first.trained):], "the rest of the run, batch for batch"
    for name, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, full.model.state_dict()[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_service_mixture_trains_the_same_batches(tmp_path, three_sources, tokenizer, monkeypatch):
    """POST /v1/mixtures (three sources, their weights, the config's seed) -> one dataset id; `pf-trl train
    --dataset_service_url/--dataset_id` on it draws the same batches as the data config through the Python API."""
    from pf_trl.cli.train import build, parse_args
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    from test_service_support import Server, wait_state

    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))
    server = Server(tmp_path / "svc", [three_sources]).start()
    try:
        body = {"sources": [
            {"name": "alpaca", "source": {"path": str(three_sources / "alpaca.jsonl")}, "weight": 0.5,
             "options": {"max_seq_len": 512}},
            {"name": "sharegpt", "source": {"path": str(three_sources / "sharegpt.jsonl")}, "weight": 0.3,
             "options": {"max_seq_len": 512, "input_format": "sharegpt"}},
            {"name": "chats", "source": {"path": str(three_sources / "chats.jsonl")}, "weight": 0.2,
             "options": {"max_seq_len": 512}}], "mixture": {"seed": 11}}
        with server.client() as client:
            r = client.post("/v1/mixtures", json=body)
            assert r.status_code in (200, 202), r.text
            dataset_id = r.json()["id"]
            done = wait_state(client, dataset_id, timeout=300)
            assert done["state"] == "succeeded", done
            assert client.post("/v1/mixtures", json=body).json()["id"] == dataset_id  # content-addressed
            bad = client.post("/v1/mixtures", json={**body, "sources": [{**body["sources"][0], "weight": None},
                                                                        *body["sources"][1:]]})
            assert bad.status_code == 422 and "every source a `weight`" in bad.text
            typo = client.post("/v1/mixtures", json={**body, "sources": [{**body["sources"][0], "wieght": 1}]})
            assert typo.status_code == 422 and "allowed here: name, source, weight, options" in typo.text
        sources = done["manifest"]["sources"]
        assert [(s["name"], s["input_format"], s["weight"]) for s in sources] == [
            ("alpaca", "alpaca", 0.5), ("sharegpt", "sharegpt", 0.3), ("chats", "messages", 0.2)]
        flags = ["--model_overrides", TINY_FLAG, "--max_seq_len", "512", "--output_dir", str(tmp_path / "o"),
                 "--report_to", "none", "--use_cpu", "True", "--num_train_epochs", "2", "--max_tokens_per_batch",
                 "2048", "--save_strategy", "no"]
        service = build(*parse_args(["--dataset_service_url", server.url, "--dataset_id", dataset_id, *flags]),
                        quiet=True)
        api = PaddingFreeSFTTrainer(
            build_model("pf-trl/tiny-llama", seed=42, **TINY), processing_class=tokenizer,
            train_dataset=str(three_sources / "mix.yaml"),
            args=PaddingFreeConfig(output_dir=str(tmp_path / "o2"), report_to=[], use_cpu=True, max_length=512,
                                   num_train_epochs=2, max_tokens_per_batch=2048, save_strategy="no"))
        assert _batches(service) == _batches(api)
    finally:
        server.stop()


@pytest.mark.slow
def test_pretokenize_and_inspect_a_data_config(tmp_path, three_sources, capsys, monkeypatch):
    from pf_trl.cli import inspect as inspect_cli
    from pf_trl.cli import pretokenize as pretokenize_cli

    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "mixdir"
    assert pretokenize_cli.main(["--data_config_path", str(three_sources / "mix.yaml"), str(out), "--no_progress",
                                 "--max_seq_len", "512"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in summary["sources"]] == ["alpaca", "sharegpt", "chats"]
    assert summary["mixture"]["weights"] == list(WEIGHTS) and summary["mixture"]["seed"] == 11
    assert inspect_cli.main([str(out)]) == 0
    text = capsys.readouterr().out
    assert "source sharegpt: format sharegpt" in text and "weight 0.300" in text
    assert "mixture by examples (all_exhausted, seed 11)" in text
    assert pretokenize_cli.main(["--data_config", str(three_sources / "mix.yaml"), str(out)]) == 2  # exists
    assert "already exists" in capsys.readouterr().err


def test_train_cli_checks_a_data_config_before_loading_anything(tmp_path, three_sources):
    from pf_trl.cli.train import TrainCLIError, precheck

    (tmp_path / "gone.yaml").write_text(
        f"datasets:\n  - {{name: a, sampling: 1, data_paths: [{tmp_path / 'missing.jsonl'}]}}\n")
    with pytest.raises(TrainCLIError, match="dataset 'a': data path .*missing.jsonl: no such file"):
        precheck(["--data_config", str(tmp_path / "gone.yaml")], say=lambda _: None)
    with pytest.raises(TrainCLIError, match="pass one of --training_data_path / --data_config"):
        precheck(["--data_config", str(three_sources / "mix.yaml"), "--training_data_path",
                  str(three_sources / "alpaca.jsonl")], say=lambda _: None)


def test_rename_and_retain_columns_apply_before_tokenizing(tmp_path, three_sources, tokenizer, monkeypatch):
    from pf_trl.data.data_config import read_data_config
    from pf_trl.data.mixture import load_mixture

    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))
    rows = [json.loads(line) for line in (three_sources / "chats.jsonl").read_text().splitlines()[:8]]
    write_jsonl(tmp_path / "dialogs.jsonl", [{"dialog": r["messages"], "text": "unused"} for r in rows])
    (tmp_path / "renamed.yaml").write_text(
        "datasets:\n  - name: dialogs\n    data_paths: [dialogs.jsonl]\n"
        "    rename_columns: {dialog: messages}\n    retain_columns: [messages]\n")
    mixture = load_mixture(read_data_config(tmp_path / "renamed.yaml"), tokenizer)
    assert mixture.pf_manifest["sources"][0]["input_format"] == "messages"
    assert mixture.pf_manifest["mixture"] is None and mixture.num_rows == 8
