"""Every user error of `pf-trl train` / `pretokenize` is found before torch or transformers is imported (so it answers
in a second, not after a minute of imports): one line, exit 2. Flags are checked against the flag table of the full
parser (`pf_trl.cli.flag_table`), never abbreviated; a bad JSON line is found by a streaming scan and numbered as an
editor numbers it, with no reader log line before it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_jsonl

ROWS = [{"instruction": f"Say {i}", "input": "", "output": f"Number {i}."} for i in range(80)]

# Each case runs in one fresh interpreter; at the end it reports whether torch / transformers were imported.
SCRIPT = r"""
import contextlib, io, json, sys
from pf_trl.cli.main import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    out.append([rc, err.getvalue()])
print(json.dumps({"cases": out, "heavy": sorted(m for m in ("torch", "transformers", "trl") if m in sys.modules)}))
"""


def run_cases(cases: list[list[str]], cwd: Path, env_cache: Path) -> tuple[list, list[str]]:
    import os

    env = {**os.environ, "PF_TRL_CACHE": str(env_cache)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    body = json.loads(proc.stdout.splitlines()[-1])
    return body["cases"], body["heavy"]


def one_line(rc: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", ROWS)


@pytest.mark.slow
def test_train_user_errors_come_before_any_heavy_import(tmp_path, data, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in ROWS]
    lines.insert(56, '{"instruction": "broken" "output": "x"}')  # line 57, where an editor shows it
    bad.write_text("\n".join(lines) + "\n")
    ckpt = tmp_path / "out" / "checkpoint-6"
    ckpt.mkdir(parents=True)
    (tmp_path / "out" / "checkpoint-2").mkdir()
    from pf_trl.data.pretokenize import pretokenize

    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))
    longest = pretokenize(data, tmp_path / "shards", progress=False)["lengths"]["max"]
    base = ["train", "--training_data_path", str(data), "--output_dir", str(tmp_path / "fresh")]
    cases = {
        "typo": ([*base, "--learnin_rate", "1e-4"], ["unknown arguments: --learnin_rate 1e-4",
                                                     "did you mean --learning_rate"]),
        "prefix": ([*base, "--model_name_or_pat", "x"], ["unknown arguments: --model_name_or_pat x"]),
        "bad int": ([*base, "--max_steps", "abc"], ["--max_steps", "invalid int value: 'abc'"]),
        "bad choice": ([*base, "--lr_scheduler_type", "wobbly"], ["--lr_scheduler_type", "invalid choice"]),
        "bad bool": ([*base, "--bf16", "maybe"], ["--bf16", "maybe"]),
        "mode": ([*base, "--padding_free", "sometimes"], ["--padding_free must be one of"]),
        "eval": ([*base, "--eval_strategy", "steps"], ["--eval_strategy steps needs --validation_data_path"]),
        "option": ([*base, "--shard_size", "5KB"], ["--shard_size '5KB' is not valid"]),
        "jsonl": (["train", "--training_data_path", str(bad), "--output_dir", str(tmp_path / "fresh")],
                  ["--training_data_path", "line 57: Expecting ',' delimiter", "fix or remove that line"]),
        "checkpoints": (["train", "--training_data_path", str(data), "--output_dir", str(tmp_path / "out")],
                        ["holds 2 checkpoint(s)", "checkpoint-6 (step 6)", "--resume_from_checkpoint True",
                         "--overwrite_output_dir True"]),
        "budget": (["train", "--training_data_path", str(tmp_path / "shards"), "--output_dir", str(tmp_path / "fresh"),
                    "--max_tokens_per_batch", "8"], [f"--max_tokens_per_batch 8 is smaller than the longest example "
                                                     f"({longest} tokens)"]),
        "pretokenize jsonl": (["pretokenize", str(bad), str(tmp_path / "s")], ["line 57:", "fix or remove"]),
        "pretokenize prefix": (["pretokenize", str(data), str(tmp_path / "s"), "--max_seq", "9"],
                               ["unrecognized arguments: --max_seq"]),
    }
    results, heavy = run_cases([argv for argv, _ in cases.values()], tmp_path, tmp_path / "cache")
    for (name, (_, needles)), (rc, err) in zip(cases.items(), results):
        line = one_line(rc, err)
        for needle in needles:
            assert needle in line, (name, line)
        assert "row 56" not in err, name
    assert heavy == [], f"imported before the error: {heavy}"
    assert not (tmp_path / "s").exists() and not (tmp_path / "fresh").exists()  # nothing written


def test_resume_or_overwrite_pass_the_checkpoint_guard(tmp_path):
    from pf_trl.trainer.output_dir import OutputDirError, check_output_dir, checkpoints

    out = tmp_path / "out"
    assert check_output_dir(out) == []  # no folder yet
    for step in (10, 2, 4):
        (out / f"checkpoint-{step}").mkdir(parents=True)
    (out / "checkpoint-x").mkdir()  # not a checkpoint name
    assert [p.name for p in checkpoints(out)] == ["checkpoint-2", "checkpoint-4", "checkpoint-10"]
    with pytest.raises(OutputDirError, match=r"latest .*checkpoint-10 \(step 10\).*resume_from_checkpoint=True"):
        check_output_dir(out)
    for resume in (True, "True", "true", str(out / "checkpoint-4")):
        assert check_output_dir(out, resume_from_checkpoint=resume) == []
    for no in (None, False, "False", ""):
        with pytest.raises(OutputDirError):
            check_output_dir(out, resume_from_checkpoint=no)
    assert [p.name for p in check_output_dir(out, overwrite_output_dir=True)] == [
        "checkpoint-2", "checkpoint-4", "checkpoint-10"]


def test_the_flag_table_is_the_full_parsers(monkeypatch):
    """The shipped table matches HfArgumentParser's flags for the installed versions (regenerate it with
    `python -m pf_trl.cli.flag_table --write`); a table for other versions or sources is not used."""
    from pf_trl.cli import flag_table
    from pf_trl.cli.train import full_parser

    body = json.loads(flag_table.SHIPPED_TABLE.read_text())
    assert body["stamp"] == flag_table.stamp(), "stale: run `python -m pf_trl.cli.flag_table --write`"
    assert body["flags"] == flag_table.table_from_parser(full_parser())
    monkeypatch.setattr(flag_table, "stamp", lambda: {**body["stamp"], "transformers": "0.0.0"})
    monkeypatch.setenv("PF_TRL_CACHE", "/nonexistent-pf-trl-cache")
    assert flag_table.load() is None


@pytest.mark.parametrize("argv", [
    ["--learning_rate", "1e-4", "--bf16", "false", "--no_remove_unused_columns", "--target_modules", "q_proj", "v_proj"],
    ["--gradient_checkpointing", "--eval_strategy", "steps", "--report_to", "none", "--max_steps=3"],
    ["--lr_scheduler_type", "cosine", "--optim", "adamw_torch", "--seed", "3", "--activation_checkpointing", "false"],
])
def test_the_light_parser_accepts_what_the_full_parser_accepts(argv):
    from pf_trl.cli.train import fast_parse, parse_args

    parse_args(["--training_data_path", "x.jsonl", "--validation_data_path", "x.jsonl", *argv])
    assert fast_parse(argv) is not None


@pytest.mark.parametrize("argv", [["--bf16"], ["--max_steps", "1.5"], ["--optim", "nope"], ["--seed"],
                                  ["--lora_dropout", "x"], ["--output_di", "o"]])
def test_the_light_parser_refuses_what_the_full_parser_refuses(argv):
    from pf_trl.cli.train import TrainCLIError, fast_parse, parse_args

    with pytest.raises(TrainCLIError):
        fast_parse(argv)
    with pytest.raises(TrainCLIError):
        parse_args(["--training_data_path", "x.jsonl", *argv])


def test_the_full_parser_refuses_abbreviations_too(monkeypatch):
    from pf_trl.cli import flag_table
    from pf_trl.cli.train import TrainCLIError, fast_parse, parse_args

    monkeypatch.setattr(flag_table, "load", lambda: None)  # another transformers: no table, the full parser decides
    assert fast_parse(["--model_name_or_pat", "x"]) is None
    with pytest.raises(TrainCLIError, match="unknown arguments: --model_name_or_pat x; did you mean "
                       "--model_name_or_path"):
        parse_args(["--model_name_or_pat", "x"])
