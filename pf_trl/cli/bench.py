"""`pf-trl bench`: padded vs TRL padding-free vs pf-trl (vs TRL BFD packing), same model, data, seed, tokens.

    pf-trl bench benchmarks/scenarios/cpu_tiny.yaml [--modes padded,pf-trl] [--repeats 3] [--output-dir DIR]

Each run is a fresh subprocess (its memory peak is its own), modes are interleaved across repeats (at least two by
default: one run on a shared machine can reverse a ranking), and every mode trains exactly one epoch over the same
examples, so all modes process the same real tokens. The table gives min / median / max real tokens/s per mode; the
ratios are of medians. All modes are measured
by the same code (:class:`pf_trl.trainer.accounting.TokenAccountingMixin`): real tokens/s = real (non-padding) tokens /
``train_runtime``. Writes ``<output-dir>/bench_<name>.json`` and ``bench_<name>.png``; the default output directory
is a fresh ``pf-trl-bench/<name>-<time>`` under the current directory (never the tracked ``benchmarks/results``).

Modes:
- ``padded``: stock ``SFTTrainer`` + TRL's collator (padding to the longest of the batch), ``per_device_train_batch_size``;
- ``trl-padding-free``: stock ``SFTTrainer`` with TRL's own ``padding_free=True`` (same batch size);
- ``pf-trl``: ``PaddingFreeSFTTrainer`` (``padding_free_mode=internal``), token budget = batch size x mean length;
- ``trl-bfd``: stock ``SFTTrainer`` with ``packing=True, packing_strategy="bfd"``, rows of the same token budget.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pf_trl.errors import PfTrlError

MODES = ("padded", "trl-padding-free", "pf-trl", "trl-bfd")
LABELS = {
    "padded": "TRL SFTTrainer, padded",
    "trl-padding-free": "TRL padding_free=True",
    "pf-trl": "pf-trl (padding_free=internal)",
    "trl-bfd": "TRL packing=bfd",
}
DEFAULTS: dict[str, Any] = dict(
    model="pf-trl/tiny-llama", tokenizer=None, model_overrides={}, dataset="sample", max_seq_len=1024, per_device_train_batch_size=8,
    max_tokens_per_batch=None, examples=96, seed=0, learning_rate=2e-5, dtype="float32", modes=list(MODES), repeats=2,
    attention="sdpa", gradient_accumulation_steps=1,
)


class BenchError(PfTrlError, ValueError):
    pass


def load_scenario(path: str | Path) -> dict[str, Any]:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise BenchError(f"scenario {path} does not exist (see benchmarks/scenarios/*.yaml)")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    unknown = sorted(set(data) - set(DEFAULTS) - {"name"})
    if unknown:
        raise BenchError(f"scenario {path}: unknown keys {unknown}; known: {sorted(DEFAULTS)}")
    scenario = {**DEFAULTS, **data}
    scenario.setdefault("name", path.stem)
    bad = [m for m in scenario["modes"] if m not in MODES]
    if bad:
        raise BenchError(f"scenario {path}: unknown modes {bad}; choose from {list(MODES)}")
    return scenario


# ------------------------------------------------------------------------------------------------ worker


def _subset(scenario: dict[str, Any]):
    from pf_trl.data.pretokenize import PretokenizeConfig
    from pf_trl.data.sources import load_training_data
    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.pretrained import resolve_pretrained

    tokenizer = load_tokenizer(resolve_pretrained(scenario["tokenizer"])) if scenario.get("tokenizer") else load_tokenizer()
    source = scenario["dataset"]
    if source == "sample":
        from pf_trl.data.samples import SHAREGPT_SAMPLE

        source = str(SHAREGPT_SAMPLE)

    ds = load_training_data(source, tokenizer, PretokenizeConfig(max_seq_len=int(scenario["max_seq_len"])),
                            progress=False)
    n = min(int(scenario["examples"]), ds.num_rows)
    ds = ds.shuffle(seed=int(scenario["seed"])).select(range(n)).flatten_indices()
    return tokenizer, ds


def run_worker(scenario: dict[str, Any], mode: str) -> dict[str, Any]:
    import numpy as np
    import torch
    from trl import SFTConfig

    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer, derive_token_budget
    from pf_trl.trainer.accounting import MeasuredSFTTrainer

    torch.manual_seed(int(scenario["seed"]))
    tokenizer, ds = _subset(scenario)
    lengths = np.asarray(ds["length"])
    bs = int(scenario["per_device_train_batch_size"])
    budget = scenario["max_tokens_per_batch"] or derive_token_budget(lengths, bs)
    dtype = getattr(torch, scenario["dtype"])
    from pf_trl.pretrained import resolve_pretrained

    model = build_model(resolve_pretrained(scenario["model"]), torch_dtype=dtype, attn_implementation=scenario["attention"],
                        seed=int(scenario["seed"]), **(scenario.get("model_overrides") or {}))
    out_dir = tempfile.mkdtemp(prefix=f"pf-bench-{mode}-")
    common = dict(
        output_dir=out_dir, num_train_epochs=1, learning_rate=float(scenario["learning_rate"]), seed=int(scenario["seed"]),
        report_to=[], save_strategy="no", logging_steps=10**6, disable_tqdm=True, bf16=False, use_cpu=not torch.cuda.is_available(),
        gradient_accumulation_steps=int(scenario["gradient_accumulation_steps"]), dataloader_num_workers=0,
    )
    columns = ds.select_columns(["input_ids", "labels"])
    if mode == "pf-trl":
        args = PaddingFreeConfig(padding_free_mode="internal", per_device_train_batch_size=bs,
                                 max_tokens_per_batch=int(budget), max_length=None, **common)
        trainer = PaddingFreeSFTTrainer(model, args=args, train_dataset=ds, processing_class=tokenizer)
        batch = f"budget {budget} tok"
    elif mode in ("padded", "trl-padding-free"):
        args = SFTConfig(per_device_train_batch_size=bs, max_length=None, padding_free=mode == "trl-padding-free",
                         dataset_kwargs={"skip_prepare_dataset": True}, **common)
        trainer = MeasuredSFTTrainer(model, args=args, train_dataset=columns, processing_class=tokenizer)
        batch = f"batch {bs}"
    elif mode == "trl-bfd":
        args = SFTConfig(per_device_train_batch_size=1, max_length=int(budget), packing=True, packing_strategy="bfd",
                         **common)
        trainer = MeasuredSFTTrainer(model, args=args, train_dataset=columns, processing_class=tokenizer)
        batch = f"rows of {budget} tok"
    else:
        raise BenchError(f"unknown mode {mode!r}")
    result = trainer.train()
    m = dict(result.metrics)
    return {
        "mode": mode,
        "implementation": LABELS[mode],
        "steps": int(trainer.state.global_step),
        "examples": int(ds.num_rows),
        "batch": batch,
        "token_budget": int(budget),
        "devices": max(1, trainer.args.world_size),
        "device": str(trainer.args.device),
        "metrics": m,
    }


# ------------------------------------------------------------------------------------------------ driver


def _run_subprocess(scenario_path: str, scenario: dict[str, Any], mode: str, timeout: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        out_path = f.name
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "pf_trl.cli.bench", "--_worker", mode, "--_scenario_json", json.dumps(scenario),
           "--_out", out_path]
    started = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise BenchError(f"mode {mode} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(out_path) as f:
        result = json.load(f)
    os.unlink(out_path)
    result["wall_s"] = round(time.time() - started, 2)
    return result


def summarize(scenario: dict[str, Any], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_mode.setdefault(r["mode"], []).append(r)
    for mode in [m for m in MODES if m in by_mode]:
        rs = by_mode[mode]
        tps = [r["metrics"]["train_real_tokens_per_second"] for r in rs]
        rt = [r["metrics"]["train_runtime"] for r in rs]
        mem = [r["metrics"].get("train_mem_cpu_peak_delta", 0) / 2**20 for r in rs]
        gpu = [r["metrics"].get("train_mem_gpu_peak", 0) / 2**20 for r in rs]
        first = rs[0]["metrics"]
        rows.append({
            "mode": mode,
            "implementation": rs[0]["implementation"],
            "dataset": "sharegpt-sample" if scenario["dataset"] == "sample" else str(scenario["dataset"]),
            "model": scenario["model"],
            "steps": rs[0]["steps"],
            "devices": rs[0]["devices"],
            "batch": rs[0]["batch"],
            "repeats": len(rs),
            "examples": rs[0].get("examples"),
            "train_runtime_s": round(statistics.median(rt), 3),
            "real_tokens_per_second": round(statistics.median(tps), 2),
            "real_tokens_per_second_min": round(min(tps), 2),
            "real_tokens_per_second_max": round(max(tps), 2),
            "real_tokens_per_second_runs": tps,
            "real_tokens": first["train_real_tokens"],
            "supervised_tokens": first["train_supervised_tokens"],
            "processed_tokens": first["train_processed_tokens"],
            "padding_share": first["train_padding_share"],
            "tokens_per_step_mean": first.get("train_tokens_per_step_mean"),
            "micro_batch_tokens_max": first.get("train_micro_batch_tokens_max"),
            "peak_mem_delta_mb": round(statistics.median(mem), 1),
            "peak_rss_mb": round(statistics.median([r["metrics"]["train_mem_cpu_peak"] / 2**20 for r in rs]), 1),
            "peak_gpu_mb": round(statistics.median(gpu), 1) if any(gpu) else None,
            "final_loss": first.get("train_loss"),
        })
    base = next((r for r in rows if r["mode"] == "padded"), None)
    trl_pf = next((r for r in rows if r["mode"] == "trl-padding-free"), None)
    for r in rows:
        r["speedup_vs_padded"] = round(r["real_tokens_per_second"] / base["real_tokens_per_second"], 3) if base else None
        r["pct_increase_vs_padded"] = round(100 * (r["speedup_vs_padded"] - 1), 1) if base else None
        r["speedup_vs_trl_padding_free"] = (
            round(r["real_tokens_per_second"] / trl_pf["real_tokens_per_second"], 3) if trl_pf else None)
        r["peak_mem_vs_padded"] = (round(r["peak_mem_delta_mb"] / base["peak_mem_delta_mb"], 3)
                                   if base and base["peak_mem_delta_mb"] else None)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ["implementation", "dataset", "model", "steps", "devices", "batch / budget", "runs",
              "train runtime (s, median)", "real tok/s min / median / max", "% vs padded (median)",
              "peak mem delta (MB)", "padding share"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        pct = "-" if r["pct_increase_vs_padded"] is None else f"{r['pct_increase_vs_padded']:+.1f}%"
        spread = (f"{r['real_tokens_per_second_min']:.0f} / {r['real_tokens_per_second']:.0f} / "
                  f"{r['real_tokens_per_second_max']:.0f}")
        lines.append("| " + " | ".join(str(x) for x in [
            r["implementation"], r["dataset"], r["model"], r["steps"], r["devices"], r["batch"], r["repeats"],
            f"{r['train_runtime_s']:.1f}", spread, pct, f"{r['peak_mem_delta_mb']:.0f}",
            f"{r['padding_share']:.1%}",
        ]) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str, footer: str) -> None:
    """Bars are medians, whiskers span min..max over the repeats; ``footer`` names examples, repeats and machine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    names = [r["implementation"].replace(" (", "\n(").replace(", ", ",\n") for r in rows]
    colors = ["#999999" if r["mode"] != "pf-trl" else "#2a7ab9" for r in rows]
    med = [r["real_tokens_per_second"] for r in rows]
    err = [[m - r["real_tokens_per_second_min"] for m, r in zip(med, rows)],
           [r["real_tokens_per_second_max"] - m for m, r in zip(med, rows)]]
    axes[0].bar(names, med, color=colors, yerr=err, capsize=4)
    axes[0].set_ylabel("real (non-padding) tokens / s\n(median; whiskers: min..max)")
    for i, r in enumerate(rows):
        if r["speedup_vs_padded"]:
            axes[0].annotate(f"{r['speedup_vs_padded']:.2f}x", (i, r["real_tokens_per_second_max"]), ha="center",
                             va="bottom")
    axes[1].bar(names, [r["peak_mem_delta_mb"] for r in rows], color=colors)
    axes[1].set_ylabel("peak memory during training (MB above start)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title)
    fig.text(0.5, 0.01, footer, ha="center", va="bottom", fontsize=8, color="#444444")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_summary() -> str:
    """One line naming the machine: CPU model and cores, or the GPU."""
    import platform

    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, CPU"


def default_output_dir(name: str) -> Path:
    """A fresh folder per run, so a bench never overwrites committed results or an earlier run."""
    return Path("pf-trl-bench") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pf-trl bench", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("scenario", nargs="?", default="benchmarks/scenarios/cpu_tiny.yaml", help="scenario YAML")
    p.add_argument("--modes", default=None, help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs per mode, interleaved (default: the scenario's, else 2); the table shows min/median/max")
    p.add_argument("--examples", type=int, default=None, help="override the scenario's example count")
    p.add_argument("--output-dir", "--output_dir", dest="output_dir", default=None,
                   help="where to write the JSON and PNG (default: a fresh pf-trl-bench/<scenario>-<time>)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    p.add_argument("--_scenario_json", help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args._worker:
        import logging
        import warnings

        warnings.filterwarnings("ignore")
        logging.disable(logging.WARNING)
        result = run_worker(json.loads(args._scenario_json), args._worker)
        with open(args._out, "w") as f:
            json.dump(result, f)
        return 0
    try:
        scenario = load_scenario(args.scenario)
        if args.modes:
            modes = [m.strip() for m in args.modes.split(",") if m.strip()]
            bad = [m for m in modes if m not in MODES]
            if bad:
                raise BenchError(f"unknown modes {bad}; choose from {list(MODES)}")
            scenario["modes"] = modes
        if args.repeats is not None:
            if args.repeats < 1:
                raise BenchError(f"--repeats must be >= 1, got {args.repeats}")
            scenario["repeats"] = args.repeats
        if args.examples:
            scenario["examples"] = args.examples
        if int(scenario["repeats"]) < 2:
            print("pf-trl bench: note: one run per mode shows no spread; on a shared machine one run can reverse a "
                  "ranking (use --repeats 2 or more)", file=sys.stderr)
        # build the data cache once, before the timed subprocesses
        _subset(scenario)
        runs = []
        for rep in range(int(scenario["repeats"])):
            order = scenario["modes"] if rep % 2 == 0 else list(reversed(scenario["modes"]))
            for mode in order:
                print(f"pf-trl bench: {scenario['name']}: {mode} (run {rep + 1}/{scenario['repeats']})", flush=True)
                runs.append(_run_subprocess(args.scenario, scenario, mode, args.timeout))
    except BenchError as exc:
        print(f"pf-trl bench: error: {exc}", file=sys.stderr)
        return 2
    rows = summarize(scenario, runs)
    table = format_table(rows)
    print(table)
    out = Path(args.output_dir) if args.output_dir else default_output_dir(scenario["name"])
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_summary()
    import platform

    import torch
    import transformers
    import trl

    report = {
        "scenario": scenario,
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "trl": trl.__version__,
                        "cpu_count": os.cpu_count(), "cuda": torch.cuda.is_available(),
                        "device": runs[0].get("device") if runs else None, "machine": machine},
        "rows": rows,
        "runs": runs,
        "table_markdown": table,
    }
    stem = f"bench_{scenario['name']}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    footer = (f"{rows[0]['real_tokens']} real tokens from {rows[0]['examples']} examples per run, "
              f"{scenario['repeats']} interleaved repeat(s) per mode; {machine}; torch {torch.__version__}")
    plot(rows, out / f"{stem}.png", f"{scenario['name']}: {scenario['model']}, max_seq_len {scenario['max_seq_len']}",
         footer)
    print(f"pf-trl bench: wrote {out / (stem + '.json')} and {out / (stem + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
