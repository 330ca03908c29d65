"""`pf-trl train`: the seed's command line, the shipped sample end to end, the data cache, clear errors."""

from __future__ import annotations

import json
import shlex
import warnings
from pathlib import Path

import in_process
import pytest

from tolerances import BF16_LOSS_RTOL, assert_same_math

SEED_CMD = (
    "--model_name_or_path pf-trl/tiny-llama --padding_free huggingface --packing False --max_seq_len 4096 "
    "--learning_rate 2e-5 --torch_dtype float16 --use_flash_attn True --response_template '### Response:' "
    "--dataset_text_field output --include_tokens_per_second True --num_train_epochs 1 --gradient_accumulation_steps 1 "
    "--gradient_checkpointing True --evaluation_strategy no --save_strategy no --weight_decay 0.01 --warmup_steps 10 "
    "--adam_epsilon 1e-4 --lr_scheduler_type linear --logging_strategy steps --logging_steps 10 --max_steps 100 "
    "--training_data_path {data} --per_device_train_batch_size 4 --output_dir {out} --skip_memory_metrics False"
)
TINY_OVERRIDES = "num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def seed_json(tmp_path_factory, sample_shards):
    """The seed's pre-tokenized JSON (input_ids + labels per row), made from the shipped sample."""
    from pf_trl.data.shards import load_shards

    ds = load_shards(sample_shards)
    path = tmp_path_factory.mktemp("seed") / "train.json"
    with open(path, "w") as f:
        for row in ds.select(range(60)):
            f.write(json.dumps({"input_ids": row["input_ids"], "labels": row["labels"]}) + "\n")
    return path


def run_cli(args: str | list[str]) -> int:
    from pf_trl.cli.main import main

    argv = shlex.split(args) if isinstance(args, str) else args
    return main(["train", *argv])


@pytest.mark.slow
def test_seed_command_line_parses_and_runs(tmp_path, seed_json, capsys):
    out = tmp_path / "ilab"
    cmd = SEED_CMD.format(data=seed_json, out=out).replace("--max_steps 100", "--max_steps 1")
    assert run_cli(cmd) == 0
    text = capsys.readouterr().out
    assert "float16 on CPU: training in float32" in text
    assert "flash-attention is not usable here (training on CPU" in text and "varlen attention" in text
    assert "tokenizing" in text
    metrics = json.loads((out / "train_results.json").read_text())
    assert metrics["train_padding_share"] == 0.0
    assert metrics["train_tokens_per_second"] == metrics["train_real_tokens_per_second"] > 0
    assert "train_mem_cpu_alloc_delta" in metrics and "train_mem_cpu_peaked_delta" in metrics  # skip_memory_metrics False
    assert "train_mem_cpu_peak" in metrics
    # the second run reads the content-addressed cache: no tokenization
    assert run_cli(cmd) == 0
    text = capsys.readouterr().out
    assert "cache hit" in text and "tokenizing" not in text


def test_seed_flags_map_onto_the_config(seed_json, tmp_path):
    from pf_trl.cli.train import parse_args

    cmd = SEED_CMD.format(data=seed_json, out=tmp_path)
    model_args, data_args, config = parse_args(shlex.split(cmd))
    assert (config.padding_free, config.padding_free_mode, config.packing) == (True, "huggingface", False)
    assert config.eval_strategy == "no" and config.skip_memory_metrics is False
    assert config.include_tokens_per_second and config.use_flash_attn
    assert data_args.max_seq_len == 4096 and data_args.response_template == "### Response:"
    assert config.dataset_text_field == "output" and model_args.torch_dtype == "float16"


@pytest.mark.slow
def test_sample_end_to_end_raw_prompt_completion(tmp_path, sample_path, sample_rows, capsys):
    out = tmp_path / "run"
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in sample_rows[:40]))
    cmd = (f"--training_data_path {sample_path} --validation_data_path {val} --max_seq_len 256 "
           f"--model_overrides {TINY_OVERRIDES} --max_steps 2 --per_device_train_batch_size 4 --output_dir {out} "
           "--report_to none --logging_steps 1 --eval_strategy steps --eval_steps 2 --per_device_eval_batch_size 64 "
           "--max_eval_tokens_per_batch 16384 --padding_free_mode internal --save_strategy no")
    assert run_cli(cmd) == 0
    text = capsys.readouterr().out
    assert "eval_loss" in text and "train_real_tokens_per_second" in text
    metrics = json.loads((out / "train_results.json").read_text())
    assert metrics["train_real_tokens"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        ("--packing True --padding_free huggingface", "packing=True conflicts"),
        ("--padding_free sometimes", "padding_free must be one of"),
        ("--no_such_flag 3", "unknown arguments"),
        ("--training_data_path /nonexistent/data.json", "no such file"),
        ("", "no training data"),
        ("--model_name_or_path ./no/such-model", "nor a Hub id"),
        ("--eval_strategy steps", "needs --validation_data_path"),
        ("--dataset_service_url http://x", "needs --dataset_id"),
    ],
)
def test_bad_flags_give_clear_errors(tmp_path, seed_json, capsys, args, message):
    if "--training_data_path" not in args and "--dataset_service_url" not in args and args != "":
        args += f" --training_data_path {seed_json}"
    assert run_cli(f"{args} --output_dir {tmp_path}") == 2
    assert message in capsys.readouterr().err


def test_bad_data_gives_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2\n')
    assert run_cli(f"--training_data_path {bad} --output_dir {tmp_path / 'o'}") == 2
    err = capsys.readouterr().err
    assert "line 2" in err and str(bad) in err
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"output": "hello"}\n')
    assert run_cli(f"--training_data_path {nofield} --output_dir {tmp_path / 'o'}") == 2
    assert "response_template" in capsys.readouterr().err


@pytest.mark.slow
def test_dataset_service_is_wired(tmp_path, sample_shards, monkeypatch, capsys):
    import pf_trl.data.service_client as client

    calls = []

    def fake_wait(url, dataset_id, *, token=None, timeout_s=3600, progress=True, **kw):
        calls.append((url, dataset_id, token))
        return sample_shards

    monkeypatch.setattr(client, "wait_for_dataset", fake_wait)
    cmd = (f"--dataset_service_url http://svc:8000 --dataset_id ds-1 --dataset_service_token tok "
           f"--model_overrides {TINY_OVERRIDES} --max_steps 1 --output_dir {tmp_path / 'o'} --report_to none "
           "--padding_free_mode internal")
    assert run_cli(cmd) == 0
    assert calls == [("http://svc:8000", "ds-1", "tok")]
    assert "service dataset ds-1" in capsys.readouterr().out


@pytest.mark.slow
def test_plain_cpu_run_is_quiet_and_says_where_things_are(tmp_path, seed_json):
    """A plain CPU run prints no framework warning (their causes are fixed, not filtered), no per-save progress bar,
    one line where the model went, and on resume one line saying where it resumed."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    base = [sys.executable, "-m", "pf_trl.cli.main", "train", "--model_name_or_path", "pf-trl/tiny-llama",
            "--model_overrides", TINY_OVERRIDES, "--training_data_path", str(seed_json), "--output_dir", str(out),
            "--max_seq_len", "1024", "--per_device_train_batch_size", "2", "--save_strategy", "steps",
            "--save_steps", "2", "--logging_steps", "1", "--disable_tqdm", "True"]
    env = {**os.environ, "PYTHONWARNINGS": "default", "PF_TRL_CACHE": str(tmp_path / "cache")}

    def run(*extra: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([*base, *extra], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    first = run("--max_steps", "2")
    noise = [line for line in first.stderr.splitlines() if "Warning" in line or "Writing model shards" in line]
    assert noise == [], noise
    assert f"pf-trl: model saved to {out}" in first.stdout
    # the resumed run in the test's process (tests/in_process.py): every warning it raises is recorded as
    # PYTHONWARNINGS=default prints it (those of the imports were the first run's, above)
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("default")
        warnings.warn("pf-trl test: recorded", UserWarning, stacklevel=1)  # control: the record sees a warning raised here
        resumed = in_process.run_cli(["train", *base[4:], "--max_steps", "3", "--resume_from_checkpoint", "True"],
                                     env=env, cwd=Path.cwd())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"pf-trl: resuming from {out / 'checkpoint-2'}: step 2, epoch 1, after batch 2 of" in resumed.stdout
    assert not [line for line in resumed.stderr.splitlines() if "Warning" in line]
    assert [str(w.message) for w in raised[:1]] == ["pf-trl test: recorded"]
    assert not raised[1:], [f"{w.category.__name__}: {w.message}" for w in raised[1:]]
    # in the test's process (tests/in_process.py): this claim is the command's output alone
    unsaved = in_process.run_cli(["train", *base[4:], "--max_steps", "1", "--save_strategy", "no", "--output_dir",
                                  str(tmp_path / "unsaved")], env=env, cwd=Path.cwd())
    assert unsaved.returncode == 0, unsaved.stderr[-3000:]
    assert "no model saved" in unsaved.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["huggingface", "internal"])
def test_bf16_on_cpu_trains(tmp_path, mode):
    """A new user's first mixed-precision run, as the README writes it: `pf-trl train --training_data_path m.jsonl
    --bf16 True --use_cpu True` (24 chat rows, the default tiny model). It used to crash both padding-free modes on
    the first attention layer (`expected scalar type Float but found BFloat16`). bf16 is on: the loss differs from
    the float32 run's, by bfloat16 rounding only."""
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. " * (1 + i % 4)}]}
            for i in range(24)]
    data = tmp_path / "m.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    losses = {}
    for bf16 in ("True", "False"):
        out = tmp_path / f"out-{bf16}"
        assert run_cli(["--training_data_path", str(data), "--bf16", bf16, "--use_cpu", "True", "--max_steps", "1",
                        "--padding_free_mode", mode, "--output_dir", str(out), "--save_strategy", "no",
                        "--report_to", "none", "--disable_tqdm", "True"]) == 0
        losses[bf16] = json.loads((out / "train_results.json").read_text())["train_loss"]
    # bf16 was on: with bf16 ignored both runs are the same float32 operations in the same order, so equal to the
    # bit (the gap is small, 7e-6 relative seen: an untrained model's loss is ~log(vocab))
    assert losses["True"] != losses["False"]
    assert_same_math(losses["True"], losses["False"], what="bf16 vs float32 loss", rtol=BF16_LOSS_RTOL)
