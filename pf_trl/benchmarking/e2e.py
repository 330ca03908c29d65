"""The end-to-end GPU bench: every arm of :mod:`pf_trl.benchmarking.arms` on the same rows, steady state.

Per dataset, ``repeats`` rounds; each round runs every arm once, the order rotated by one arm per round (the arm
that went first, paying any cold cache, goes last next time). Each arm: a fresh model and trainer, ``warmup_steps``
untimed steps, then synchronized steps until ``min_steps`` timed steps or ``min_seconds`` (whichever first), GPU
peaks reset at its start. The report is rewritten after every arm, so a run cut short keeps what it measured.

Everything in the report's ``table`` is recomputable from its ``runs`` (per-step seconds and tokens, the FLOP
parameters, the peak): :func:`recompute_table` does it, and the tests check that it gives the same table.
"""

from __future__ import annotations

import gc
import hashlib
import json
import platform
import statistics
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pf_trl.benchmarking.arms import ARMS, BenchSetup, build_trainer, skip_reason
from pf_trl.benchmarking.rows import DATA_DIR, load_shapes, rows_from_shapes
from pf_trl.benchmarking.steady import StepTimer, summarize

H200_BF16_DENSE_TFLOPS = 989.0  # the datasheet's dense bf16 peak, the MFU denominator on an H200


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "trl", "accelerate", "datasets", "triton", "flash-attn", "flash-attn-4",
                 "nvidia-cutlass-dsl", "liger-kernel"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def machine(cuda: bool) -> dict[str, Any]:
    import os

    import torch

    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "cuda": cuda}
    if cuda:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gb=round(p.total_memory / 2**30, 1))
    return info


def arm_order(arms: list[str], round_index: int) -> list[str]:
    """``arms`` rotated left by ``round_index``: every arm takes every position over ``len(arms)`` rounds."""
    k = round_index % len(arms) if arms else 0
    return arms[k:] + arms[:k]


def run_arm(arm: str, setup: BenchSetup, rows: list[dict], *, budget: int, cuda: bool, warmup_steps: int,
            min_steps: int, min_seconds: float, max_steps: int | None = None) -> dict[str, Any]:
    """One arm: train, time, return its record (or the error, with the arm's traceback tail)."""
    import torch

    from pf_trl.trainer.metrics import detect_peak_tflops, model_flop_params

    reason = skip_reason(arm, cuda)
    if reason:
        return {"arm": arm, "skipped": reason}
    held: dict[str, Any] = {}  # the trainer, for the timer's meter reads; dropped at the end to free the GPU
    timer = StepTimer(lambda: held["trainer"].pf_metrics.meter, warmup_steps=warmup_steps, min_steps=min_steps,
                      min_seconds=min_seconds, cuda=cuda)
    started = time.perf_counter()
    # what an earlier arm left allocated (should be ~0): it would also sit inside this arm's peak
    leftover = int(torch.cuda.memory_allocated()) if cuda else 0
    try:
        steps = max_steps if max_steps is not None else warmup_steps + min_steps
        with tempfile.TemporaryDirectory(prefix=f"pf-e2e-{arm}-") as out:
            trainer, described = build_trainer(arm, setup, rows, budget=budget, max_steps=steps, cuda=cuda,
                                               output_dir=out, callbacks=[timer])
            held["trainer"] = trainer
            flop_params = model_flop_params(trainer.model)
            peak = detect_peak_tflops(torch.device("cuda"), getattr(torch, setup.dtype)) if cuda else None
            result = trainer.train()
        record = {**described, **timer.record(), "flop_params": list(flop_params), "peak_tflops": peak,
                  "gpu_allocated_before_build_bytes": leftover,
                  "train_runtime_s": round(float(result.metrics.get("train_runtime", 0.0)), 3),
                  "wall_s": round(time.perf_counter() - started, 2),
                  "final_loss": result.metrics.get("train_loss")}
        record["summary"] = summarize(record, flop_params=flop_params, peak_tflops=peak)
        return record
    except Exception as exc:  # one arm failing (a kernel missing on this GPU) must not lose the others
        return {"arm": arm, "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-3000:], "steps": timer.steps}
    finally:
        held.clear()
        trainer = None  # the last reference: the model and optimizer go with it
        gc.collect()
        if arm == "pf-trl-compile":
            torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()


def recompute_table(runs: list[dict[str, Any]], datasets: list[str]) -> list[dict[str, Any]]:
    """Per (dataset, arm): medians over the repeats of each figure, ratios to ``trl-padded`` (same dataset)."""
    table = []
    for ds in datasets:
        by_arm: dict[str, list[dict]] = {}
        for r in runs:
            if r["dataset"] == ds and "steps" in r and "summary" in r:
                s = summarize(r, flop_params=tuple(r["flop_params"]), peak_tflops=r["peak_tflops"])
                by_arm.setdefault(r["arm"], []).append({**s, "_record": r})
        base = None
        for arm in [a for a in ARMS if a in by_arm]:
            ss = by_arm[arm]
            tps = [s["real_tokens_per_second"] for s in ss]

            keys = ("real_tokens_per_second", "supervised_tokens_per_second", "gpu_max_allocated_gb",
                    "gpu_max_reserved_gb", "mfu", "tflops", "padding_share", "timed_steps", "timed_seconds")
            row = {"dataset": ds, "arm": arm, "repeats": len(ss), **{k: _median(ss, k) for k in keys},
                   "real_tokens_per_second_runs": tps,
                   "attention": ss[0]["_record"].get("varlen_kernel") or ss[0]["_record"].get("varlen_backend")
                   or ss[0]["_record"].get("attn_implementation")}
            if arm == "trl-padded":
                base = row["real_tokens_per_second"]
            row["ratio_to_padded"] = round(row["real_tokens_per_second"] / base, 3) if base else None
            table.append(row)
    return table


def _median(summaries: list[dict[str, Any]], key: str) -> float | None:
    vals = [s[key] for s in summaries if s.get(key) is not None]
    return round(statistics.median(vals), 4) if vals else None


def format_table(table: list[dict[str, Any]]) -> str:
    head = ["dataset", "arm", "attention", "real tok/s", "supervised tok/s", "x padded", "MFU", "padding",
            "GPU alloc / reserved (GB)", "timed steps x repeats"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        mem = ("-" if r["gpu_max_allocated_gb"] is None
               else f"{r['gpu_max_allocated_gb']:.1f} / {r['gpu_max_reserved_gb']:.1f}")
        ratio = "-" if r["ratio_to_padded"] is None else f"{r['ratio_to_padded']:.2f}x"
        lines.append("| " + " | ".join(str(x) for x in [
            r["dataset"], r["arm"], r["attention"], f"{r['real_tokens_per_second']:,.0f}",
            f"{r['supervised_tokens_per_second']:,.0f}", ratio, mfu, f"{100 * r['padding_share']:.1f}%", mem,
            f"{r['timed_steps']:.0f} x {r['repeats']}"]) + " |")
    return "\n".join(lines)


def bench(setup: BenchSetup, *, datasets: dict[str, list[str]], repeats: int, rows_per_dataset: int,
          warmup_steps: int, min_steps: int, min_seconds: float, cuda: bool, out_path: Path,
          deadline: float | None = None, max_len: int | None = None,
          repeat_arms: list[str] | None = None) -> dict[str, Any]:
    """Run every (dataset, round, arm); write ``out_path`` after each arm; return the report.

    ``repeat_arms``: the arms of the rounds after the first (default: all), for a run that has time for every arm
    once but for the main ones only twice; the table says how many runs each figure is the median of.
    """
    from pf_trl.data.prepare import derive_token_budget

    report: dict[str, Any] = {
        "bench": "pf-trl end-to-end, steady state", "setup": asdict(setup), "versions": versions(),
        "machine": machine(cuda), "repeats": repeats, "warmup_steps": warmup_steps, "min_steps": min_steps,
        "min_seconds": min_seconds, "repeat_arms": repeat_arms,
        "peak_tflops_note": f"dense bf16 peak, H200: {H200_BF16_DENSE_TFLOPS} TFLOP/s",
        "mfu_formula": "(6 * P * real_tokens + 7 * layers * hidden * sum(example_length^2)) / seconds / peak; "
                       "P = parameters without the input embedding; attention forward+backward = 3.5x forward",
        "datasets": {}, "runs": [], "table": [],
    }
    import numpy as np

    for ds_name, arms in datasets.items():
        doc = load_shapes(ds_name)
        shapes = doc["shapes"][:rows_per_dataset]
        from pf_trl.models import embedded_config

        vocab = embedded_config(setup.model, **setup.model_overrides).vocab_size
        rows = rows_from_shapes(shapes, vocab, seed=setup.seed, max_len=max_len)
        lengths = np.asarray([len(r["input_ids"]) for r in rows])
        budget = derive_token_budget(lengths, setup.batch_size)
        path = DATA_DIR / f"lengths_{ds_name}.json"
        report["datasets"][ds_name] = {
            **{k: v for k, v in doc.items() if k != "shapes"}, "file": f"benchmarks/data/{path.name}",
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "rows_used": len(rows),
            "mean_length_used": round(float(lengths.mean()), 1), "pf_trl_token_budget": int(budget)}
        for rnd in range(repeats):
            this_round = list(arms) if rnd == 0 or repeat_arms is None else [a for a in arms if a in repeat_arms]
            for arm in arm_order(this_round, rnd):
                if deadline is not None and time.time() > deadline:
                    report["cut_short"] = f"deadline reached before {ds_name} round {rnd + 1} {arm}"
                    break
                print(f"e2e: {ds_name} round {rnd + 1}/{repeats}: {arm}", flush=True)
                rec = run_arm(arm, setup, rows, budget=budget, cuda=cuda, warmup_steps=warmup_steps,
                              min_steps=min_steps, min_seconds=min_seconds)
                rec.update(dataset=ds_name, round=rnd)
                report["runs"].append(rec)
                status = rec.get("skipped") or rec.get("error") or rec["summary"]
                print(f"e2e:   -> {status}", flush=True)
                report["table"] = recompute_table(report["runs"], list(datasets))
                out_path.write_text(json.dumps(report, indent=1))
    report["table_markdown"] = format_table(report["table"])
    out_path.write_text(json.dumps(report, indent=1))
    return report


def seed_experiment(setup: BenchSetup, *, dataset: str, steps: int, cuda: bool, out_path: Path,
                    warmup_steps: int = 3, arms: tuple[str, ...] = ("trl-padded", "pf-trl"),
                    max_len: int | None = None) -> dict[str, Any]:
    """The seed's experiment: ``steps`` padded steps of ``batch_size`` rows vs pf-trl over the SAME rows (one pass,
    token budget ``batch_size`` x mean length). Runtime = the sum of all synchronized step times (warm-up included,
    as a user's ``train_runtime``); tokens/s and MFU over the steps after ``warmup_steps``."""
    import numpy as np

    from pf_trl.data.prepare import derive_token_budget

    doc = load_shapes(dataset)
    from pf_trl.models import embedded_config

    vocab = embedded_config(setup.model, **setup.model_overrides).vocab_size
    rows = rows_from_shapes(doc["shapes"][: steps * setup.batch_size], vocab, seed=setup.seed, max_len=max_len)
    lengths = np.asarray([len(r["input_ids"]) for r in rows])
    budget = derive_token_budget(lengths, setup.batch_size)
    report: dict[str, Any] = {
        "bench": "the seed's experiment: padded vs pf-trl on the same rows", "setup": asdict(setup),
        "versions": versions(), "machine": machine(cuda), "dataset": {k: v for k, v in doc.items() if k != "shapes"},
        "rows": len(rows), "real_tokens": int(lengths.sum()), "pf_trl_token_budget": int(budget),
        "seed_reference": {"padded_s": 79.4, "padding_free_s": 57.8, "speedup": 1.37,
                           "what": "Mistral-7B, Alpaca, 1 GPU, batch 4, 100 steps (the seed's figures)"},
        "runs": [],
    }
    for arm in arms:
        print(f"seed: {arm}", flush=True)
        rec = run_arm(arm, setup, rows, budget=budget, cuda=cuda, warmup_steps=warmup_steps, min_steps=10**9,
                      min_seconds=float("inf"), max_steps=steps if arm.startswith("trl-") else -1)
        if "steps" in rec and "summary" in rec:
            rec["runtime_all_steps_s"] = round(sum(s["seconds"] for s in rec["steps"]), 3)
            rec["real_tokens_all_steps"] = int(sum(s["real"] for s in rec["steps"]))
        report["runs"].append(rec)
        print(f"seed:   -> {rec.get('error') or rec.get('skipped') or rec.get('runtime_all_steps_s')}", flush=True)
        out_path.write_text(json.dumps(report, indent=1))
    done = {r["arm"]: r for r in report["runs"] if "runtime_all_steps_s" in r}
    if "trl-padded" in done and "pf-trl" in done:
        padded, ours = done["trl-padded"]["runtime_all_steps_s"], done["pf-trl"]["runtime_all_steps_s"]
        report["speedup_runtime"] = round(padded / ours, 3)
        report["same_tokens"] = done["trl-padded"]["real_tokens_all_steps"] == done["pf-trl"]["real_tokens_all_steps"]
    out_path.write_text(json.dumps(report, indent=1))
    return report
