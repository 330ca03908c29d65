"""Quiet by default: `pf-trl train --help` prints the full parser's help from a table, without importing torch or
transformers; each pf-trl warning is said once per run (train and eval data alike) and on rank 0 only; DeepSpeed's
"Setting accelerator to CPU" line is not printed unless DeepSpeed is used."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from conftest import LogRecords

HEAVY = ("torch", "transformers", "trl")

HELP_SCRIPT = r"""
import contextlib, io, json, sys
from pf_trl.cli import flag_table
if sys.argv[1] == "stale":  # another transformers: no table fits
    real = flag_table.stamp
    flag_table.stamp = lambda: {**real(), "transformers": "0.0.0"}
from pf_trl.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main(["train", "--help"])
print(json.dumps({"rc": rc, "help": out.getvalue(), "heavy": sorted(m for m in HEAVY if m in sys.modules)}))
""".replace("HEAVY", repr(HEAVY))


def _help(tmp_path, mode: str) -> dict:
    env = {**os.environ, "PF_TRL_CACHE": str(tmp_path / "cache"), "COLUMNS": "100"}
    proc = subprocess.run([sys.executable, "-c", HELP_SCRIPT, mode], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_help_comes_from_the_table_without_heavy_imports(tmp_path):
    """Negative control: with no table for the installed versions the full parser prints it (transformers imported),
    the same text."""
    fast = _help(tmp_path, "shipped")
    assert fast["rc"] == 0 and fast["heavy"] == []
    assert "--report_to" in fast["help"] and "--padding_free_mode" in fast["help"]
    assert "'option_strings'" not in fast["help"]  # a bare % in a help text makes argparse print its internals
    slow = _help(tmp_path, "stale")
    assert slow["rc"] == 0 and "transformers" in slow["heavy"]
    assert slow["help"] == fast["help"]


@pytest.mark.slow
def test_the_help_table_is_the_full_parsers(monkeypatch):
    """Regenerated with the flag table (`python -m pf_trl.cli.flag_table --write`); formats the same help."""
    from pf_trl.cli import flag_table, help_table
    from pf_trl.cli.train_args import full_parser

    monkeypatch.setenv("COLUMNS", "100")
    body = json.loads(help_table.SHIPPED_HELP.read_text())
    assert body["stamp"] == flag_table.stamp(), "stale: run `python -m pf_trl.cli.flag_table --write`"
    full = full_parser()
    assert body["options"] == help_table.help_rows(full)["options"]
    light = help_table.help_parser(body)
    light.prog = full.prog = "pf-trl"
    assert light.format_help() == full.format_help()


def test_a_warning_once_per_run_on_rank_zero(monkeypatch):
    from pf_trl import _quiet

    records = LogRecords()
    logger = logging.getLogger("pf_trl.trainer")
    logger.addHandler(records)
    try:
        _quiet.start_run()
        for _ in range(3):
            logger.warning("pf-trl: the same thing")
        logger.warning("pf-trl: another thing")
        logger.error("pf-trl: an error")
        logger.error("pf-trl: an error")  # errors are never dropped
        assert records.messages == ["pf-trl: the same thing", "pf-trl: another thing", "pf-trl: an error",
                                    "pf-trl: an error"]
        _quiet.start_run()  # a new run says it again
        logger.warning("pf-trl: the same thing")
        monkeypatch.setenv("RANK", "1")
        _quiet.start_run()
        logger.warning("pf-trl: said by rank 0 only")
        logger.error("pf-trl: an error on rank 1")
    finally:
        logger.removeHandler(records)
    assert records.messages[4:] == ["pf-trl: the same thing", "pf-trl: an error on rank 1"]


def test_every_pf_trl_logger_is_filtered():
    """Each logger pf-trl logs under carries the filter (a new module-level logger must be added to the list)."""
    import re
    from pathlib import Path

    from pf_trl import _quiet

    root = Path(_quiet.__file__).parent
    names = set()
    for path in root.rglob("*.py"):
        for match in re.finditer(r"getLogger\((__name__|\"(pf_trl[\w.]*)\")\)", path.read_text(encoding="utf-8")):
            module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
            names.add(module if match.group(1) == "__name__" else match.group(2))
    assert names and names <= set(_quiet.LOGGERS), names - set(_quiet.LOGGERS)


TRAINER_SCRIPT = r"""
import logging, os, sys, datasets
logging.basicConfig(level=logging.WARNING)
from pf_trl.models import build_model
from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer
rows = [{"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": f"Hello {i}."}]}
        for i in range(8)]
args = PaddingFreeConfig(output_dir="out", report_to=[], use_cpu=True, max_steps=1, save_strategy="no")
model = build_model("pf-trl/tiny-llama", seed=0, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                    num_attention_heads=2, num_key_value_heads=1)
for rank in ("1", "0"):  # the process starts as rank 1 (RANK=1); each trainer begins a run of its own
    os.environ["RANK"] = rank
    print(f"--- rank {rank} ---", file=sys.stderr, flush=True)
    PaddingFreeSFTTrainer(model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                          eval_dataset=datasets.Dataset.from_list(rows[:4]))
print("built")
"""


@pytest.mark.slow
def test_a_trainer_says_each_warning_once_and_no_deepspeed_banner(tmp_path):
    """Through PaddingFreeSFTTrainer (train and eval chat rows, assistant_only_loss unset): the warning once, no
    DeepSpeed banner (deepspeed is installed and imported by accelerate); on rank 1, not at all. One process: the
    rank-1 trainer first, then the rank-0 one (the negative control of the rank-1 silence: the same process says it)."""
    pytest.importorskip("deepspeed")
    env = {**os.environ, "PF_TRL_CACHE": str(tmp_path / "cache"), "RANK": "1"}
    env.pop("ACCELERATE_USE_DEEPSPEED", None)
    proc = subprocess.run([sys.executable, "-c", TRAINER_SCRIPT], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0 and "built" in proc.stdout, proc.stderr[-3000:]
    rank1, rank0 = proc.stderr.split("--- rank 1 ---", 1)[1].split("--- rank 0 ---", 1)
    assert "assistant_only_loss is unset" not in rank1, rank1
    assert rank0.count("assistant_only_loss is unset") == 1, rank0
    assert "Setting accelerator to CPU" not in proc.stdout + proc.stderr  # DeepSpeed's handler writes to stdout


BANNER_SCRIPT = r"""
import sys
if sys.argv[1] == "installed":
    from pf_trl import _quiet
    _quiet.install()
import deepspeed
"""


@pytest.mark.slow
def test_the_deepspeed_banner_is_kept_when_deepspeed_is_used(tmp_path):
    """Negative controls of the filter: without it the import prints the banner; with DeepSpeed in use it stays."""
    pytest.importorskip("deepspeed")
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_USE_DEEPSPEED", "DS_ACCELERATOR")}

    def output(mode: str, **extra) -> str:
        proc = subprocess.run([sys.executable, "-c", BANNER_SCRIPT, mode], capture_output=True, text=True,
                              timeout=300, env={**env, **extra}, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout + proc.stderr  # DeepSpeed's handler writes to stdout

    if "Setting accelerator to CPU" not in output("bare"):
        pytest.skip("deepspeed found an accelerator here: no banner to silence")
    assert "Setting accelerator to CPU" not in output("installed")
    assert "Setting accelerator to CPU" in output("installed", ACCELERATE_USE_DEEPSPEED="true")
