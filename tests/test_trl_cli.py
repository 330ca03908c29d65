"""`pf-trl train` takes what `trl sft` takes: TRL's `--config` files (TrlParser's rules, compared with TrlParser
itself), `--dataset_name` on local data with its splits, `datasets:` mixtures, every ModelConfig flag honoured as TRL's
`get_peft_config` / model loading read it or refused in one line before any tokenizing, and nothing silently ignored
or redirected (LoRA flags without an adapter, `model_init_kwargs`, DatasetDict evaluation splits, a dtype or mode
pf-trl changes, `--chat_template_path`)."""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import write_jsonl as _write_jsonl
from tolerances import assert_other_math, assert_same_math

ROWS = [{"prompt": f"Question {i}: what is {i} plus {i}?", "completion": f" It is {2 * i}."} for i in range(40)]
CHAT = [{"messages": [{"role": "user", "content": f"Hello {i}"}, {"role": "assistant", "content": f"Hi, number {i}."}]}
        for i in range(12)]
TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' }}{% if m['role'] == 'assistant' %}{% generation %}"
            "{{ m['content'] + eos_token }}{% endgeneration %}{% else %}{{ m['content'] + '\n' }}{% endif %}"
            "{% endfor %}")
TINY = "--model_overrides num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2," \
       "num_key_value_heads=1"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """A model folder (tiny Llama + the embedded tokenizer, no chat template), local datasets of every kind."""
    import datasets
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("trl-cli")
    model = root / "my-model"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                                 bos_token_id=1, eos_token_id=2)).save_pretrained(model)
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None  # a base model's tokenizer: chat rows need a template given
    plain.save_pretrained(model)
    files = root / "files"  # a folder of files: splits from the file names, as datasets reads it
    write_jsonl(files / "train.jsonl", ROWS[:30])
    write_jsonl(files / "test.jsonl", ROWS[30:])
    configs = root / "configs"  # a README-declared configuration
    write_jsonl(configs / "small" / "train.jsonl", ROWS[:6])
    write_jsonl(configs / "small" / "test.jsonl", ROWS[6:9])
    write_jsonl(configs / "big" / "train.jsonl", ROWS[:20])
    (configs / "README.md").write_text(
        "---\nconfigs:\n- config_name: small\n  data_files:\n  - split: train\n    path: small/train.jsonl\n"
        "  - split: test\n    path: small/test.jsonl\n- config_name: big\n  data_files:\n  - split: train\n"
        "    path: big/train.jsonl\n---\n")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:30]),
                               "test": datasets.Dataset.from_list(ROWS[30:])})
    dd.save_to_disk(str(root / "dd"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:30]),
                          "validation": datasets.Dataset.from_list(ROWS[30:35])}).save_to_disk(str(root / "dv"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(root / "dtrain"))
    datasets.Dataset.from_list(ROWS[:10]).save_to_disk(str(root / "ds"))
    write_jsonl(root / "chat.jsonl", CHAT)
    (root / "t.jinja").write_text(TEMPLATE)
    (root / "t2.jinja").write_text(TEMPLATE.replace("<|", "[["))
    return {"root": root, "model": model, "files": files, "configs": configs, "dd": root / "dd", "dv": root / "dv",
            "dtrain": root / "dtrain", "ds": root / "ds", "chat": root / "chat.jsonl", "t": root / "t.jinja",
            "t2": root / "t2.jinja", "file": files / "train.jsonl"}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return _write_jsonl(path, rows)


def argv_of(text: str, **paths) -> list[str]:
    return shlex.split(text.format(**{k: str(v) for k, v in paths.items()}))


def parsed(argv: list[str]):
    """What `pf-trl train` parses (the config file expanded, aliases mapped), and the flags given."""
    from pf_trl.cli.model_args import given_flags
    from pf_trl.cli.train import normalize_argv, parse_args

    argv = normalize_argv(argv)
    return (*parse_args(argv), given_flags(argv))


def built(argv: list[str], capsys=None):
    """The trainer `pf-trl train` builds for ``argv`` (model, data and all), and what it printed."""
    from pf_trl.cli.train import build

    model_args, data_args, config, flags = parsed(argv)
    trainer = build(model_args, data_args, config, flags=flags)
    return trainer, (capsys.readouterr().out if capsys is not None else "")


# --------------------------------------------------------------------------------- refusals: fast, one line

# Each case runs `pf-trl train` (main) in one fresh interpreter, timed; controls run the same cheap checks (precheck)
# on the corrected command line and must pass. Reports whether torch / transformers / trl were imported.
SCRIPT = r"""
import contextlib, io, json, sys, time
from pf_trl.cli.main import main
from pf_trl.cli.train import precheck, normalize_argv
out = []
for kind, argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        if kind == "main":
            rc = main(argv)
        else:
            try:
                precheck(normalize_argv(argv[1:]), say=lambda *_: None)
                rc = 0
            except Exception as exc:
                rc, _ = 1, err.write(f"{type(exc).__name__}: {exc}")
    out.append([rc, err.getvalue(), time.perf_counter() - start])
print(json.dumps({"cases": out, "heavy": sorted(m for m in ("torch", "transformers", "trl") if m in sys.modules)}))
"""


def run_cases(cases: list[tuple[str, list[str]]], cwd: Path) -> tuple[list, list[str]]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    body = json.loads(proc.stdout.splitlines()[-1])
    return body["cases"], body["heavy"]


@pytest.mark.slow
def test_trl_flags_refused_in_one_line_within_seconds_before_any_tokenizing(world, tmp_path):
    w = world
    (tmp_path / "extra.yaml").write_text(f"dataset_name: {w['files']}\nnum_processes: 2\n")
    (tmp_path / "ok.yaml").write_text(f"dataset_name: {w['files']}\n")
    frac = json.dumps({"path": str(w["file"]), "fraction": 0.5})
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "train.jsonl").write_text(json.dumps(ROWS[0]) + "\n{\"prompt\": \"x\" \"completion\"}\n")
    base = f"train --model_name_or_path {w['model']} --output_dir {tmp_path / 'out'} "
    data = f"--dataset_name {w['files']} "
    # (refused command, expected words, corrected command that passes the same checks)
    cases = [
        (data + "--lora_r 16 --lora_target_modules q_proj", ["--lora_r --lora_target_modules are LoRA settings",
                                                             "--use_peft"],
         data + "--use_peft --lora_r 16 --lora_target_modules q_proj"),
        (data + "--r 16 --lora_alpha 32 --target_modules q_proj v_proj",
         ["no adapter is trained", "--peft_method lora", "or drop them for a full fine-tune"],
         data + "--peft_method lora --r 16 --lora_alpha 32 --target_modules q_proj v_proj"),
        (data + "--use_peft --lora_r 16 --r 8", ["both set the LoRA rank"], data + "--use_peft --lora_r 16"),
        (data + "--model_revision v2.0", ["--model_revision v2.0", "not a Hub id"], data + "--model_revision main"),
        (data + "--attn_implementation kernels-community/flash-attn", ["a Hub kernel"],
         data + "--attn_implementation sdpa"),
        (data + "--attn_implementation flash_attention_2", ["needs the flash-attn package"],
         data + "--attn_implementation sdpa"),
        (data + "--use_flash_attn True --attn_implementation sdpa", ["--use_flash_attn True and "
                                                                     "--attn_implementation sdpa disagree"],
         data + "--attn_implementation sdpa"),
        (data + "--attn_implementation eager --padding_free_mode internal", ["no eager variant"],
         data + "--attn_implementation sdpa --padding_free_mode internal"),
        (data + "--dtype bfloat16 --torch_dtype float32", ["set the model dtype to different values"],
         data + "--dtype bfloat16 --torch_dtype bfloat16"),
        (data + "--model_init_kwargs '{\"device_map\": \"auto\"}'", ["--model_init_kwargs keys ['device_map']"],
         data + "--model_init_kwargs '{\"dtype\": \"bfloat16\"}'"),
        (data + "--model_init_kwargs '{\"dtype\": \"float16\"}' --dtype bfloat16", ["different values"],
         data + "--model_init_kwargs '{\"dtype\": \"bfloat16\"}' --dtype bfloat16"),
        ("--dataset_name ./no/such-data", ["no such file or folder"], data),
        (f"--dataset_name {tmp_path / 'broken'}", ["train.jsonl", "line 2"], data),
        (data + "--dataset_train_split training", ["no 'training' split (its splits: train, test)"],
         data + "--dataset_train_split train"),
        (f"--dataset_name {w['dv']} --eval_strategy steps", ["no 'test' split (its splits: train, validation)"],
         f"--dataset_name {w['dv']} --eval_strategy steps --dataset_test_split validation"),
        (f"--dataset_name {w['configs']} --dataset_config medium", ["'medium'", "small"],
         f"--dataset_name {w['configs']} --dataset_config small"),
        (f"--dataset_name {w['file']} --dataset_config small", ["--dataset_config", "drop"],
         f"--dataset_name {w['file']}"),
        (f"--training_data_path {w['file']} --validation_data_path {w['dtrain']} --eval_strategy steps",
         ["DatasetDict with the splits train"],
         f"--training_data_path {w['file']} --validation_data_path {w['dd']} --eval_strategy steps"),
        (f"--datasets '{frac}'", ["fraction", "--data_config"], f"--datasets {w['file']}"),
        (f"--datasets {w['file']} --eval_strategy steps", ["no test split"],
         f"--datasets {w['file']} --eval_strategy steps --validation_data_path {w['file']}"),
        (data + "--dataset_streaming", ["--dataset_streaming True", "set --max_steps"],
         data + "--dataset_streaming --max_steps 3"),
        (f"--datasets {w['file']} --streaming true", ["--streaming True", "set --max_steps"],
         f"--datasets {w['file']} --streaming true --max_steps 3"),
        (f"--training_data_path {w['file']} --dataset_streaming --max_steps 3",
         ["--dataset_streaming True streams --dataset_name", "dataprocessor.streaming"],
         f"--training_data_path {w['file']} --max_steps 3"),
        (data + "--streaming true --max_steps 3", ["--streaming True streams a `datasets:` mixture",
                                                   "--dataset_streaming True"],
         data + "--dataset_streaming true --max_steps 3"),
        (data + "--test_split_size 0.1", ["--test_split_size", "--dataset_test_split"], data),
        (data + "--ignore_bias_buffers true", ["--ignore_bias_buffers"], data),
        (data + "--use_peft --lora_task_type SEQ_CLS", ["CAUSAL_LM"], data + "--use_peft --lora_task_type CAUSAL_LM"),
        (data + "--bnb_4bit_quant_type fp4", ["only applies with --load_in_4bit"], data),
        (data + "--load_in_8bit", ["cannot be trained without an adapter", "--use_peft"], data),
        (data + "--trust_remote_code True --model_init_kwargs '{\"trust_remote_code\": false}'",
         ["--trust_remote_code True and --model_init_kwargs trust_remote_code False disagree"],
         data + "--trust_remote_code True --model_init_kwargs '{\"trust_remote_code\": true}'"),
        (f"--config {tmp_path / 'extra.yaml'}", ["num_processes is no flag of pf-trl train", "accelerate launch"],
         f"--config {tmp_path / 'ok.yaml'}"),
        (f"--training_data_path {w['chat']} --chat_template_path {w['root']}", ["is a folder", "Jinja file"],
         f"--training_data_path {w['chat']} --chat_template_path {w['t']}"),
        (f"--training_data_path {w['chat']} --chat_template_path {w['t']} --chat_template {w['t2']}",
         ["different files"],
         f"--training_data_path {w['chat']} --chat_template_path {w['t']} --chat_template {w['t']}"),
    ]
    runs = []
    for bad, _, good in cases:
        runs += [("main", shlex.split(base + bad)), ("precheck", shlex.split(base + good))]
    results, heavy = run_cases(runs, tmp_path)
    assert heavy == [], f"a refusal imported {heavy}"
    for (bad, words, good), (rc, err, seconds), (ok_rc, ok_err, _) in zip(cases, results[::2], results[1::2]):
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (bad, err)
        for word in words:
            assert word in lines[0], (bad, lines[0])
        # no heavy import (above) is what shows it came before any tokenizing; the bound is loose for a loaded machine
        assert seconds < 15, (bad, seconds)
        assert ok_rc == 0, (good, ok_err)  # negative control: the corrected command passes the same checks


def test_qlora_on_cpu_is_refused_in_one_line_before_the_data(world, tmp_path, capsys):
    import torch

    from pf_trl.cli.main import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: QLoRA is honoured there")
    start = time.perf_counter()
    rc = main(["train", "--model_name_or_path", str(world["model"]), "--dataset_name", str(world["files"]),
               "--use_peft", "--load_in_4bit", "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--load_in_4bit needs a CUDA device" in err[0], err
    assert time.perf_counter() - start < 15  # seconds, not a model build (loose: a loaded 2-core machine)
    assert not (tmp_path / "cache" / "datasets").exists()  # nothing was tokenized


# ------------------------------------------------------------------------------------- --config (TrlParser)


def test_config_file_as_trlparser_reads_it_command_line_overrides(world, tmp_path, monkeypatch):
    """The same YAML and command line through TRL's own TrlParser (trl sft's make_parser) and `pf-trl train`: the
    same values; the command line wins over the file; `env:` is set."""
    from trl.scripts.sft import make_parser

    monkeypatch.delenv("PF_TRL_TEST_FROM_ENV", raising=False)
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(
        f"model_name_or_path: {world['model']}\ndataset_name: {world['files']}\nlearning_rate: 3.0e-4\n"
        "lr_scheduler_type: cosine\nmax_length: 512\nuse_peft: true\nlora_r: 8\n"
        "lora_target_modules: [q_proj, v_proj]\nlora_dropout: 0.1\nmodel_init_kwargs: {dtype: bfloat16}\n"
        "num_train_epochs: 2\ngradient_accumulation_steps: 4\nreport_to: [tensorboard, wandb]\neval_strategy: 'no'\n"
        "bf16: false\n"
        "env:\n  PF_TRL_TEST_FROM_ENV: from-the-file\n")
    cli = ["--config", str(cfg), "--learning_rate", "1e-3", "--max_length", "256", "--output_dir", str(tmp_path)]
    script, trl_args, trl_model, _ = make_parser().parse_args_and_config(cli)
    monkeypatch.delenv("PF_TRL_TEST_FROM_ENV")
    model_args, data_args, config, _ = parsed(cli)
    assert os.environ["PF_TRL_TEST_FROM_ENV"] == "from-the-file"
    for name in ("learning_rate", "lr_scheduler_type", "max_length", "num_train_epochs", "gradient_accumulation_steps",
                 "report_to", "model_init_kwargs"):
        assert getattr(config, name) == getattr(trl_args, name), name
    for name in ("use_peft", "lora_r", "lora_target_modules", "lora_dropout", "model_name_or_path"):
        assert getattr(model_args, name) == getattr(trl_model, name), name
    assert data_args.dataset_name == script.dataset_name
    assert config.learning_rate == 1e-3 and config.max_length == 256 and data_args.max_seq_len == 256  # CLI wins
    # negative control: without the command line's values, the file's
    _, data_args, config, _ = parsed(["--config", str(cfg), "--output_dir", str(tmp_path)])
    assert config.learning_rate == 3e-4 and config.max_length == 512 and data_args.max_seq_len == 512
    # one setting, two names: --max_seq_len on the command line overrides the file's max_length
    _, data_args, config, _ = parsed(["--config", str(cfg), "--max_seq_len", "128", "--output_dir", str(tmp_path)])
    assert config.max_length == 128 == data_args.max_seq_len


TRL_DOCS_EXAMPLE = """\
# This is an example configuration file of TRL CLI, you can use it for
# SFT like that: `trl sft --config config.yaml --output_dir test-sft`
# The YAML file supports environment variables by adding an `env` field
# as below

# env:
#     CUDA_VISIBLE_DEVICES: 0

model_name_or_path:
  {model}
dataset_name:
  {data}
report_to:
  none
learning_rate:
  0.0001
lr_scheduler_type:
  cosine
"""


@pytest.mark.slow
def test_trl_docs_config_example_trains_unchanged_but_its_paths(world, tmp_path, capsys):
    """TRL's example config (trl/examples/cli_configs/example_config.yaml), its hub ids replaced by local paths, run
    as its comment says (`--config config.yaml --output_dir test-sft`; a step limit added to stay cheap)."""
    from pf_trl.cli.main import main

    cfg = tmp_path / "config.yaml"
    cfg.write_text(TRL_DOCS_EXAMPLE.format(model=world["model"], data=world["files"]))
    out = tmp_path / "test-sft"
    assert main(["train", "--config", str(cfg), "--output_dir", str(out), "--max_steps", "2"]) == 0
    text = capsys.readouterr().out
    assert f"--dataset_name {world['files']}: training on its 'train' split" in text
    metrics = json.loads((out / "train_results.json").read_text())
    assert metrics["train_examples"] > 0 and (out / "model.safetensors").is_file()
    args = __import__("torch").load(out / "training_args.bin", weights_only=False)
    assert (args.learning_rate, str(args.lr_scheduler_type.value)) == (1e-4, "cosine")


# ----------------------------------------------------------------------------------- local datasets, splits


def test_dataset_name_reads_every_local_kind_as_datasets_does(world, tmp_path, tokenizer):
    import datasets

    from pf_trl.data.local_datasets import LocalDatasetError, dataset_splits
    from pf_trl.data.pretokenize import pretokenize

    w = world
    assert dataset_splits(str(w["file"])) == {"train": [str(w["file"])]}
    files = dataset_splits(str(w["files"]))
    assert sorted(files) == ["test", "train"] and files["test"] == [str(w["files"] / "test.jsonl")]
    small = dataset_splits(str(w["configs"]), config="small")
    reference = datasets.load_dataset(str(w["configs"]), name="small", cache_dir=str(tmp_path / "hf"))
    assert sorted(small) == sorted(reference)
    assert sum(1 for f in small["test"] for _ in open(f)) == reference["test"].num_rows == 3
    assert sorted(dataset_splits(str(w["configs"]), config="big")) == ["train"]
    with pytest.raises(LocalDatasetError, match="'medium'"):  # negative control: datasets' own refusal, one line
        dataset_splits(str(w["configs"]), config="medium")
    assert dataset_splits(str(w["dd"])) == {"train": [str(w["dd"] / "train")], "test": [str(w["dd"] / "test")]}
    assert dataset_splits(str(w["ds"])) == {"train": [str(w["ds"])]}
    shards = tmp_path / "shards"
    for split, rows in (("train", ROWS[:20]), ("test", ROWS[20:])):
        pretokenize(write_jsonl(tmp_path / f"{split}.jsonl", rows), shards / split, tokenizer=tokenizer,
                    progress=False)
    assert dataset_splits(str(shards / "train")) == {"train": [str(shards / "train")]}
    assert dataset_splits(str(shards)) == {"test": [str(shards / "test")], "train": [str(shards / "train")]}


@pytest.mark.slow
def test_dataset_name_trains_the_train_split_and_evaluates_the_test_split(world, tmp_path, capsys):
    base = f"--model_name_or_path {world['model']} --output_dir {tmp_path / 'o'} --max_seq_len 256 "
    trainer, text = built(argv_of(base + "--dataset_name {dd} --eval_strategy steps --eval_steps 5", dd=world["dd"]),
                          capsys)
    assert (len(trainer.train_dataset), len(trainer.eval_dataset)) == (30, 10)
    assert "evaluating on its 'test' split" in text
    # negative control: another test split is another evaluation set
    trainer, _ = built(argv_of(base + "--dataset_name {dd} --eval_strategy steps --dataset_test_split train",
                               dd=world["dd"]))
    assert len(trainer.eval_dataset) == 30
    # evaluation off: the test split is not read (trl sft passes no eval_dataset either)
    trainer, _ = built(argv_of(base + "--dataset_name {dd}", dd=world["dd"]))
    assert trainer.eval_dataset is None
    # a folder of files, a split of several files (concatenated)
    write_jsonl(tmp_path / "multi" / "train-00000-of-00002.jsonl", ROWS[:7])
    write_jsonl(tmp_path / "multi" / "train-00001-of-00002.jsonl", ROWS[7:20])
    trainer, _ = built(argv_of(base + "--dataset_name {m}", m=tmp_path / "multi"))
    assert len(trainer.train_dataset) == 20


@pytest.mark.slow
def test_validation_datasetdict_evaluates_its_test_or_validation_split(world, tmp_path, capsys):
    base = (f"--model_name_or_path {world['model']} --output_dir {tmp_path / 'o'} "
            f"--training_data_path {world['file']} --eval_strategy steps ")
    trainer, text = built(shlex.split(base + f"--validation_data_path {world['dd']}"), capsys)
    assert len(trainer.eval_dataset) == 10 and "evaluating on its 'test' split" in text  # not its 30 train rows
    trainer, text = built(shlex.split(base + f"--validation_data_path {world['dv']}"), capsys)
    assert len(trainer.eval_dataset) == 5 and "'validation' split" in text


@pytest.mark.slow
def test_trl_datasets_mixture_concatenates_the_entries(world, tmp_path):
    cfg = tmp_path / "mix.yaml"
    cfg.write_text(f"model_name_or_path: {world['model']}\ndatasets:\n  - path: {world['file']}\n"
                   f"  - path: {world['files']}\n    split: test\n    columns: [prompt, completion]\n"
                   f"  - path: {world['configs']}\n    name: small\n")
    trainer, _ = built(["--config", str(cfg), "--output_dir", str(tmp_path / "o")])
    assert len(trainer.train_dataset) == 30 + 10 + 6
    cfg.write_text(f"model_name_or_path: {world['model']}\ndatasets:\n  - path: {world['file']}\n")
    trainer, _ = built(["--config", str(cfg), "--output_dir", str(tmp_path / "o")])
    assert len(trainer.train_dataset) == 30  # negative control: one entry, its rows only


def _losses(argv: list[str]) -> tuple[list[float], bool]:
    trainer, _ = built(argv)
    trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row], trainer._pf_stream is not None


def test_dataset_streaming_trains_the_losses_of_the_same_rows_read_whole(tmp_path):
    """--dataset_streaming True on a local file takes pf-trl's streaming path (tokenized while training: no shards in
    the cache) and trains the losses of a non-streaming data config over the same rows. With a look-ahead buffer of
    the whole file and a budget that holds it, every step of both runs is the whole split, whatever the packing
    order (the packing order differs, so the losses agree within float rounding, not to the bit). Negative control:
    the same streamed run on a file with one completion changed trains other losses."""
    rows = write_jsonl(tmp_path / "rows.jsonl", ROWS[:12])
    changed = write_jsonl(tmp_path / "changed.jsonl", [*ROWS[:11], {**ROWS[11], "completion": " It is not 22."}])
    (tmp_path / "plain.yaml").write_text("dataprocessor: {type: default, streaming: false}\ndatasets:\n"
                                         f"  - {{name: rows, data_paths: [{rows}]}}\n")
    common = argv_of("--max_steps 3 --logging_steps 1 --max_length 64 --max_tokens_per_batch 512 --learning_rate 1e-3 "
                     "--report_to none --save_strategy no --disable_tqdm true --output_dir {out} " + TINY,
                     out=tmp_path / "out")
    stream = ["--dataset_streaming", "True", "--stream_buffer_size", "12", *common]
    streamed, was_stream = _losses(["--dataset_name", str(rows), *stream])
    assert was_stream and not list((tmp_path / "cache").glob("datasets/*/pf_manifest.json"))  # nothing tokenized ahead
    whole, was_whole_stream = _losses(["--data_config", str(tmp_path / "plain.yaml"), *common])
    assert not was_whole_stream and list((tmp_path / "cache").glob("datasets/*/pf_manifest.json"))
    assert len(streamed) == 3
    # the same rows, packed in another order: the same sums in another order, equal up to float rounding
    assert_same_math(streamed, whole, what="streamed vs whole losses")
    other, _ = _losses(["--dataset_name", str(changed), *stream])
    assert_other_math(other, streamed, what="one completion changed")  # gap 8e-4: 800 x the 1e-6 tolerance


# ------------------------------------------------------------------------------- model flags, said or honoured


def test_lora_flags_give_trls_own_peft_config(world, tmp_path):
    """--use_peft and the lora_* flags build what TRL's get_peft_config builds from the same ModelConfig."""
    from trl import ModelConfig, get_peft_config

    from pf_trl.cli.model_args import peft_config

    flags = ("--use_peft --lora_r 4 --lora_alpha 8 --lora_dropout 0.0 --lora_target_modules q_proj v_proj "
             "--use_rslora --use_dora --lora_modules_to_save lm_head")
    model_args, _, _, given = parsed(shlex.split(f"--dataset_name {world['files']} {flags} --output_dir {tmp_path}"))
    ours = peft_config(model_args, given)
    theirs = get_peft_config(ModelConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                                         lora_target_modules=["q_proj", "v_proj"], use_rslora=True, use_dora=True,
                                         lora_modules_to_save=["lm_head"]))
    for name in ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "use_dora", "modules_to_save",
                 "bias", "task_type"):
        assert getattr(ours, name) == getattr(theirs, name), name
    model_args, _, _, given = parsed(shlex.split(f"--dataset_name {world['files']} --use_peft --output_dir {tmp_path}"))
    assert peft_config(model_args, given).r == 16  # TRL's default rank with TRL's switch
    model_args, _, _, given = parsed(shlex.split(f"--dataset_name {world['files']} --peft_method lora "
                                                 f"--output_dir {tmp_path}"))
    assert peft_config(model_args, given).r == 8  # pf-trl's (fms-hf-tuning's) default with its own switch
    model_args, _, _, given = parsed(shlex.split(f"--dataset_name {world['files']} --output_dir {tmp_path}"))
    assert peft_config(model_args, given) is None  # negative control: no switch, no adapter


@pytest.mark.slow
def test_use_peft_trains_and_saves_trls_adapter(world, tmp_path):
    from pf_trl.cli.main import main

    out = tmp_path / "lora"
    assert main(["train", "--model_name_or_path", str(world["model"]), "--dataset_name", str(world["files"]),
                 "--use_peft", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj", "--max_steps", "1",
                 "--output_dir", str(out), "--report_to", "none"]) == 0
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    assert not (out / "model.safetensors").exists()  # an adapter, not a full model


@pytest.mark.slow
def test_model_init_kwargs_dtype_and_attention_are_honoured(world, tmp_path):
    import torch

    base = f"--model_name_or_path {world['model']} --dataset_name {world['files']} --output_dir {tmp_path} "
    trainer, _ = built(shlex.split(base + "--model_init_kwargs '{\"dtype\": \"bfloat16\", \"attn_implementation\": "
                                          "\"eager\"}'"))
    assert trainer.model.dtype == torch.bfloat16 and trainer.model.config._attn_implementation == "eager"
    trainer, _ = built(shlex.split(base + "--dtype bfloat16"))  # TRL's ModelConfig name
    assert trainer.model.dtype == torch.bfloat16
    trainer, _ = built(shlex.split(base))  # negative control: the folder's own dtype and attention
    assert trainer.model.dtype == torch.float32 and trainer.model.config._attn_implementation != "eager"


def test_attn_implementation_maps_onto_pf_trls_kernels(world, tmp_path):
    from pf_trl.cli.model_args import model_settings

    base = f"--dataset_name {world['files']} --output_dir {tmp_path} "
    model_args, _, config, given = parsed(shlex.split(base + "--attn_implementation sdpa --padding_free_mode internal"))
    settings = model_settings(model_args, config, given, cuda=False, flash_choice=lambda: (None, "no flash package"))
    assert (config.attention_backend, settings.attn_implementation) == ("sdpa", None)
    model_args, _, config, given = parsed(shlex.split(base + "--attn_implementation eager"))
    settings = model_settings(model_args, config, given, cuda=False, flash_choice=lambda: (None, "no flash package"))
    assert (config.padding_free_mode, settings.attn_implementation) == ("huggingface", "eager")
    model_args, _, config, given = parsed(shlex.split(base + "--padding_free_mode internal"))
    settings = model_settings(model_args, config, given, cuda=False, flash_choice=lambda: (None, "no flash package"))
    assert (config.attention_backend, settings.attn_implementation) == ("auto", None)  # negative control


@pytest.mark.slow
def test_a_dtype_or_mode_pf_trl_changes_is_said_once(world, tmp_path, capsys):
    import torch

    base = f"--model_name_or_path {world['model']} --dataset_name {world['files']} --output_dir {tmp_path} "
    trainer, text = built(shlex.split(base + "--torch_dtype float16 --use_flash_attn True --padding_free huggingface"),
                          capsys)
    assert trainer.model.dtype == torch.float32 and trainer.args.padding_free_mode == "internal"
    assert text.count("float16 on CPU: training in float32") == 1
    assert text.count("padding_free_mode huggingface -> internal") == 1
    trainer, text = built(shlex.split(base + "--torch_dtype float32 --padding_free huggingface"), capsys)
    assert "warning" not in text and trainer.args.padding_free_mode == "huggingface"  # negative control


@pytest.mark.slow
def test_chat_template_path_means_chat_template(world, tmp_path):
    from pf_trl.cli.train import TrainCLIError

    base = f"--model_name_or_path {world['model']} --training_data_path {world['chat']} --output_dir {tmp_path} "
    trl_name, _ = built(shlex.split(base + f"--chat_template_path {world['t']}"))
    pf_name, _ = built(shlex.split(base + f"--chat_template {world['t']}"))
    assert trl_name.train_dataset["input_ids"] == pf_name.train_dataset["input_ids"]
    assert trl_name.train_dataset["labels"] == pf_name.train_dataset["labels"]
    with pytest.raises(TrainCLIError, match="chat template"):  # negative control: no template, chat rows refused
        built(shlex.split(base))


def test_a_change_pf_trl_makes_is_said_on_rank_zero_only(monkeypatch, capsys):
    from pf_trl.cli.model_args import warn_once

    monkeypatch.setenv("RANK", "1")
    warn_once("something changed")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")  # negative control: rank 0 says it
    warn_once("something changed")
    assert capsys.readouterr().out == "pf-trl: warning: something changed\n"
